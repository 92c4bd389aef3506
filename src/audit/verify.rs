//! `meshca audit verify`: reading the chained log back. The chain is checked
//! here (links, runs, signed checkpoints, recorded damage); the log against
//! its anchors outside the pod in [`anchors`]; what the command prints in
//! [`summary`].

use std::collections::HashSet;
use std::io::BufRead;
use std::path::Path;

use super::format::{
    damage_digest, line_hash, parse_line, Checkpoint, LineHead, Parsed, Recovery, GENESIS,
};
use super::keys::{check_signature, VerifyKey};

pub mod anchors;
pub mod summary;

/// Where verification first failed, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyFailure {
    /// `file:line`.
    pub location: String,
    pub seq: Option<u64>,
    pub why: String,
}

impl std::fmt::Display for VerifyFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.seq {
            Some(seq) => write!(f, "{} (seq {seq}): {}", self.location, self.why),
            None => write!(f, "{}: {}", self.location, self.why),
        }
    }
}

impl std::error::Error for VerifyFailure {}

/// A recovery the writer recorded after finding a damaged log on start (or a
/// failed write): reported, not a verification failure, when the damaged
/// lines are exactly the ones its checkpoint names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryNote {
    /// `file:line` of the recovery checkpoint.
    pub location: String,
    pub recovery: Recovery,
    /// The damaged lines were present and matched the checkpoint's digest
    /// (false when they are in a file that was not given).
    pub damaged_lines_checked: bool,
}

impl std::fmt::Display for RecoveryNote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = &self.recovery;
        let what = match r.found.as_str() {
            "torn_line" => "the log ended in a torn (incomplete) line",
            "unparsable_tail" => "the log ended in unparsable data",
            "oversize_line" => "the log's last line was over the line cap",
            "write_error" => "a write failed part-way",
            _ => "damage",
        };
        write!(f, "{}: recovery: {what}", self.location)?;
        if r.damaged_lines > 0 {
            write!(
                f,
                "; {} damaged line(s), {} bytes, sha256 {}{}",
                r.damaged_lines,
                r.damaged_bytes,
                r.damaged_sha256.escape_debug(),
                if self.damaged_lines_checked {
                    " (present and matching)"
                } else {
                    " (not in the files given)"
                }
            )?;
        }
        if let Some(n) = r.last_line_bytes {
            write!(f, "; last line {n} bytes")?;
        }
        if r.continued {
            write!(f, "; the chain continues from the last good line")
        } else {
            write!(f, "; a new chain segment starts here")?;
            if let Some(file) = &r.old_file {
                write!(f, ", the damaged log was kept as {}", file.escape_debug())?;
            }
            if let Some(h) = &r.old_head {
                write!(f, " (its last line had sha256 {})", h.escape_debug())?;
            }
            Ok(())
        }
    }
}

/// What a successful verification covered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    pub records: u64,
    pub checkpoints: u64,
    pub signed_checkpoints: u64,
    /// Chains started afresh (process restarts on the stdout sink).
    pub chain_starts: u64,
    pub first_seq: Option<u64>,
    pub last_seq: Option<u64>,
    /// Records after the last checkpoint: not yet covered by a signature.
    pub unsigned_tail: u64,
    /// Recoveries from damaged tails or failed writes, in order.
    pub recoveries: Vec<RecoveryNote>,
    /// Records the sink wrote in reduced form (over the line cap).
    pub reduced_records: u64,
    /// Runs (process lifetimes) in order, as their checkpoints name them.
    pub runs: Vec<RunSummary>,
    /// Where a new chain started mid-log, accepted by `allow_new_chain`.
    pub new_chains: Vec<String>,
    /// The log began with a run continuing an earlier one (accepted by
    /// `partial`): `file:line` and the seq it continues from.
    pub partial_start: Option<(String, u64)>,
    /// Reason of the last line when it is a checkpoint (`shutdown` after a
    /// clean stop).
    pub last_checkpoint_reason: Option<String>,
    /// Requests shed (refused without a record) as the last checkpoint of
    /// each run says, summed.
    pub shed: u64,
    /// Runs that continued from their anchored checkpoint after a crash:
    /// `file:line` of the new run's start, and how many records the crashed
    /// run wrote after that checkpoint (in the log, no longer on the chain's
    /// continuing path, and covered by no checkpoint).
    pub orphaned: Vec<(String, u64)>,
}

/// One run of the writer as the log shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSummary {
    pub replica: String,
    pub run: String,
    /// `file:line` of its first checkpoint.
    pub location: String,
    pub first_seq: u64,
    /// Audit records of this run covered by its checkpoints.
    pub records: u64,
    /// Its last checkpoint's reason.
    pub last_reason: String,
    pub shed: u64,
}

/// How strictly a log is read.
#[derive(Debug, Clone, Copy, Default)]
pub struct VerifyOptions<'a> {
    /// Keys whose signatures are accepted (old keys after a rotation
    /// included), chosen by each checkpoint's `key_id`. Empty: signatures
    /// are not checked.
    pub keys: &'a [VerifyKey],
    /// Accept a new chain (seq 0) in the middle of the log.
    pub allow_new_chain: bool,
    /// Accept a log that begins with a run continuing an earlier one that
    /// is not given (the earlier files were deleted or are elsewhere).
    pub partial: bool,
}

/// Per-run state while reading.
#[derive(Debug)]
struct RunState {
    run: String,
    started: bool,
    /// Records since the run's previous checkpoint (known once one was seen).
    since_checkpoint: Option<u64>,
}

/// If lines `i..j` are unparsable and line `j` is a recovery checkpoint that
/// names exactly them, returns `j`.
fn explained_damage<L: AsRef<[u8]>>(lines: &[(String, L)], i: usize) -> Option<usize> {
    let mut j = i;
    while j < lines.len() && parse_line(lines[j].1.as_ref()).is_err() {
        j += 1;
    }
    let Ok(Parsed::Checkpoint(cp)) = parse_line(lines.get(j)?.1.as_ref()) else {
        return None;
    };
    let r = cp.recovery.as_ref()?;
    let damaged: Vec<&[u8]> = lines[i..j].iter().map(|(_, l)| l.as_ref()).collect();
    let (bytes, sha) = damage_digest(&damaged);
    (cp.reason == "recovery"
        && r.damaged_lines == (j - i) as u64
        && r.damaged_bytes == bytes
        && r.damaged_sha256 == sha)
        .then_some(j)
}

/// Verifies lines in order (one or more files, oldest first). With `key`,
/// every checkpoint must carry a valid signature by it. Damaged lines are
/// accepted only when a recovery checkpoint right after them names them
/// (their count, size and SHA-256); the recovery is then reported. A new
/// chain mid-log and a log that begins after an earlier run both fail (see
/// [`verify_lines_with`] to accept them).
pub fn verify_lines<L: AsRef<[u8]>>(
    lines: &[(String, L)],
    key: Option<&VerifyKey>,
) -> Result<VerifyReport, VerifyFailure> {
    let keys: Vec<VerifyKey> = key.cloned().into_iter().collect();
    verify_lines_with(
        lines,
        &VerifyOptions {
            keys: &keys,
            ..Default::default()
        },
    )
}

/// [`verify_lines`] with options: several keys (rotation), and the two
/// explicit exceptions an operator may grant.
pub fn verify_lines_with<L: AsRef<[u8]>>(
    lines: &[(String, L)],
    opts: &VerifyOptions<'_>,
) -> Result<VerifyReport, VerifyFailure> {
    let mut report = VerifyReport::default();
    let mut run: Option<RunState> = None;
    let mut seen_runs: HashSet<String> = HashSet::new();
    // (seq, line hash) from the last checkpoint on: where a new run may fork.
    let mut tail: Vec<(u64, String)> = Vec::new();
    let mut expected: Option<(u64, String)> = None;
    let mut i = 0;
    let mut explained_until = 0;
    while i < lines.len() {
        let (location, line) = (&lines[i].0, lines[i].1.as_ref());
        let fail = |seq: Option<u64>, why: String| VerifyFailure {
            location: location.clone(),
            seq,
            why,
        };
        let parsed = match parse_line(line) {
            Ok(p) => p,
            Err((seq, why)) => match explained_damage(lines, i) {
                Some(j) => {
                    explained_until = j;
                    i = j;
                    continue;
                }
                None => return Err(fail(seq, why)),
            },
        };
        let seq = Some(parsed.seq());
        let checkpoint = match &parsed {
            Parsed::Checkpoint(cp) => Some(&**cp),
            Parsed::Audit { record, .. } => {
                if record.reduced.is_some() {
                    report.reduced_records += 1;
                }
                None
            }
        };
        if let Some(cp) = checkpoint {
            // v2 members are written together; the signed message reads an
            // absent count or shed as 0, so a missing one is an edit.
            if cp.run.is_some() && (cp.replica.is_none() || cp.count.is_none() || cp.shed.is_none())
            {
                return Err(fail(
                    seq,
                    "checkpoint names its run but lacks replica, count or shed (edited)".into(),
                ));
            }
            if check_signature(cp, opts.keys).map_err(|why| fail(seq, why))? {
                report.signed_checkpoints += 1;
            }
            if let Some(r) = &cp.recovery {
                if cp.reason != "recovery" {
                    return Err(fail(
                        seq,
                        "recovery details on a checkpoint that is not a recovery".into(),
                    ));
                }
                report.recoveries.push(RecoveryNote {
                    location: location.clone(),
                    recovery: r.clone(),
                    damaged_lines_checked: r.damaged_lines > 0 && explained_until == i,
                });
            }
        }
        // A (verified) start or new-segment checkpoint at genesis begins a new chain.
        let fresh_start = checkpoint.is_some_and(|cp| {
            let new_segment =
                cp.reason == "recovery" && cp.recovery.as_ref().is_some_and(|r| !r.continued);
            (cp.reason == "start" || new_segment) && cp.seq == 0 && cp.prev == GENESIS
        });
        let (head_seq, head_prev) = (parsed.seq(), parsed.prev());
        if let Some(cp) = checkpoint.filter(|cp| cp.run.is_some()) {
            if let Some(fork) = check_run(
                cp,
                &mut run,
                &mut seen_runs,
                &mut report,
                (expected.as_ref(), &tail),
                opts,
                location,
            )
            .map_err(|why| fail(seq, why))?
            {
                expected = Some(fork);
            }
        } else if checkpoint.is_none() {
            if let Some(n) = run.as_mut().and_then(|r| r.since_checkpoint.as_mut()) {
                *n += 1;
            }
        }
        if fresh_start && expected.is_some() {
            let new_segment = checkpoint.is_some_and(|cp| cp.reason == "recovery");
            if !new_segment && !opts.allow_new_chain {
                return Err(fail(seq, "a new chain (seq 0) starts in the middle of the log: the lines before it are not linked to it (a run was cut off, replaced or inserted); --allow-new-chain accepts it when the operator knows why".into()));
            }
            if !new_segment {
                report.new_chains.push(location.clone());
            }
        }
        match &expected {
            _ if fresh_start => report.chain_starts += 1,
            None => {
                let genesis = head_seq == 0 && head_prev == GENESIS;
                if !genesis && checkpoint.is_none() {
                    return Err(fail(seq, "log does not begin at the chain's start or at a checkpoint: earlier records were removed".into()));
                }
            }
            Some((want_seq, want_prev)) => {
                if head_seq != *want_seq {
                    return Err(fail(seq, format!("expected seq {want_seq}: records were removed or reordered before this line")));
                }
                if head_prev != want_prev {
                    return Err(blame_edit(lines, i, head_seq));
                }
            }
        }
        report.first_seq.get_or_insert(head_seq);
        report.last_seq = Some(head_seq);
        if let Some(cp) = checkpoint {
            report.checkpoints += 1;
            report.unsigned_tail = 0;
            report.last_checkpoint_reason = Some(cp.reason.clone());
        } else {
            report.last_checkpoint_reason = None;
            report.records += 1;
            report.unsigned_tail += 1;
        }
        let hash = line_hash(line);
        if checkpoint.is_some() {
            tail.clear();
        }
        tail.push((head_seq, hash.clone()));
        expected = Some((head_seq + 1, hash));
        i += 1;
    }
    report.shed = report.runs.iter().map(|r| r.shed).sum();
    Ok(report)
}

/// A chain position: seq and line hash.
type ChainPos = (u64, String);

/// Checks a v2 checkpoint against the run it belongs to: a run begins with
/// its `start` (or the `recovery` right before it), never repeats, stays on
/// one replica, names the head it continues from, and counts its records.
fn check_run(
    cp: &Checkpoint,
    state: &mut Option<RunState>,
    seen: &mut HashSet<String>,
    report: &mut VerifyReport,
    (expected, tail): (Option<&ChainPos>, &[ChainPos]),
    opts: &VerifyOptions<'_>,
    location: &str,
) -> Result<Option<(u64, String)>, String> {
    let (Some(id), replica) = (&cp.run, cp.replica.clone().unwrap_or_default()) else {
        return Ok(None);
    };
    let mut fork = None;
    let same_run = state.as_ref().is_some_and(|r| r.run == *id);
    if same_run {
        let r = state.as_mut().ok_or("no run")?;
        if cp.reason == "start" {
            if r.started {
                return Err(format!("a second start of run {id}"));
            }
            r.started = true;
        }
        if let (Some(have), Some(says)) = (r.since_checkpoint, cp.count) {
            if have != says {
                return Err(format!(
                    "the checkpoint counts {says} record(s) since run {id}'s previous checkpoint, but {have} are in the log: records were removed or added"
                ));
            }
        }
        r.since_checkpoint = Some(0);
        if let Some(s) = report.runs.last_mut() {
            s.records += cp.count.unwrap_or(0);
            s.last_reason = cp.reason.clone();
            s.shed = cp.shed.unwrap_or(0);
        }
        return Ok(None);
    }
    // A checkpoint of another run than the current one.
    if state.is_some() && cp.reason != "start" && cp.reason != "recovery" {
        return Err(format!(
            "a {} checkpoint of run {id} (replica {}) inside run {}: lines of another run were spliced in",
            cp.reason,
            replica.escape_debug(),
            state.as_ref().map(|r| r.run.as_str()).unwrap_or("-")
        ));
    }
    if !seen.insert(id.clone()) {
        return Err(format!("run {id} appears a second time: a replayed run"));
    }
    if let Some(first) = report.runs.first() {
        if first.replica != replica {
            return Err(format!(
                "run {id} belongs to replica {}, but this log is replica {}'s: another replica's run was spliced in",
                replica.escape_debug(),
                first.replica.escape_debug()
            ));
        }
    }
    if cp.reason == "start" || cp.reason == "recovery" {
        match (&cp.previous, expected) {
            (Some(p), Some((want_seq, want_prev))) => {
                // stdout after a crash: the run continues from the last
                // anchored checkpoint, and the crashed run's records after it
                // stay in the log, off the chain (still linked to it).
                let anchored_fork = p.from == "anchor"
                    && p.seq + 1 < *want_seq
                    && tail
                        .first()
                        .is_some_and(|(s, h)| *s == p.seq && *h == p.hash);
                if anchored_fork {
                    report
                        .orphaned
                        .push((location.to_string(), *want_seq - p.seq - 1));
                    fork = Some((p.seq + 1, p.hash.clone()));
                } else if p.seq + 1 != *want_seq || p.hash != *want_prev {
                    return Err(format!(
                        "run {id} continues from seq {} (line hash {}), but the line before it is seq {}: runs were removed, replaced or reordered",
                        p.seq,
                        p.hash.escape_debug(),
                        want_seq.saturating_sub(1)
                    ));
                }
            }
            (Some(p), None) => {
                if !opts.partial {
                    return Err(format!(
                        "the log begins with run {id}, which continues from seq {} of an earlier run: earlier runs are missing (give the older files first, or --partial)",
                        p.seq
                    ));
                }
                report.partial_start = Some((location.to_string(), p.seq));
            }
            (None, _) => {}
        }
    }
    *state = Some(RunState {
        run: id.clone(),
        started: cp.reason == "start",
        // The first checkpoint of a run counts from the run's start.
        since_checkpoint: Some(0),
    });
    report.runs.push(RunSummary {
        replica,
        run: id.clone(),
        location: location.to_string(),
        first_seq: cp.seq,
        records: cp.count.unwrap_or(0),
        last_reason: cp.reason.clone(),
        shed: cp.shed.unwrap_or(0),
    });
    Ok(fork)
}

/// The chain broke between lines `i-1` and `i` with no gap in `seq`: one of
/// the two was edited. If line `i+1` still links to line `i`, line `i` is
/// intact and the previous line was changed; otherwise line `i`'s own `prev`
/// was altered.
fn blame_edit<L: AsRef<[u8]>>(lines: &[(String, L)], i: usize, seq: u64) -> VerifyFailure {
    let next_links = lines
        .get(i + 1)
        .and_then(|(_, next)| serde_json::from_slice::<LineHead>(next.as_ref()).ok())
        .map(|h| h.prev == line_hash(lines[i].1.as_ref()));
    match (next_links, i.checked_sub(1)) {
        (Some(false), _) | (_, None) => VerifyFailure {
            location: lines[i].0.clone(),
            seq: Some(seq),
            why: "record was edited: its prev does not match the hash of the line before it".into(),
        },
        (Some(true), Some(p)) => VerifyFailure {
            location: lines[p].0.clone(),
            seq: seq.checked_sub(1),
            why: "record was edited: its hash no longer matches the next line's prev".into(),
        },
        (None, Some(p)) => VerifyFailure {
            location: lines[p].0.clone(),
            seq: seq.checked_sub(1),
            why: "the chain breaks after this record: it, or the last line's prev, was edited"
                .into(),
        },
    }
}

/// Reads `paths` in order (`-` is standard input) as `(file:line, bytes)`.
/// Lines are kept as bytes, so damaged (non-UTF-8) lines can be checked
/// against the digest a recovery checkpoint holds. A last line without a
/// newline is kept (and fails verification as truncated).
pub fn read_lines(paths: &[impl AsRef<Path>]) -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    for p in paths {
        let p = p.as_ref();
        let mut reader: Box<dyn BufRead> = if p == Path::new("-") {
            Box::new(std::io::BufReader::new(std::io::stdin()))
        } else {
            let f = std::fs::File::open(p)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", p.display())))?;
            Box::new(std::io::BufReader::new(f))
        };
        let mut n = 0;
        loop {
            let mut line = Vec::new();
            if reader.read_until(b'\n', &mut line)? == 0 {
                break;
            }
            if line.last() == Some(&b'\n') {
                line.pop();
            }
            n += 1;
            out.push((format!("{}:{n}", p.display()), line));
        }
    }
    Ok(out)
}

/// The start every line the writer writes has (`{"type":"audit"...`,
/// `{"type":"checkpoint"...`).
const LINE_START: &[u8] = b"{\"type\":\"";

/// The audit lines of a container's log, where the process's own log lines
/// (stderr) interleave with the audit stream (stdout), as `kubectl logs`
/// returns them: lines that do not start as the writer starts every line are
/// set aside and counted. Nothing that starts like an audit line is dropped,
/// so a damaged or forged one still fails the chain, and a removed one still
/// breaks it.
pub fn audit_lines_only(lines: Vec<(String, Vec<u8>)>) -> (Vec<(String, Vec<u8>)>, usize) {
    let total = lines.len();
    let kept: Vec<_> = lines
        .into_iter()
        .filter(|(_, l)| l.starts_with(LINE_START))
        .collect();
    let skipped = total - kept.len();
    (kept, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case(Some(49), "audit.log:7 (seq 49): why" ; "with seq")]
    #[test_case(None, "audit.log:7: why" ; "without seq")]
    fn failure_display_has_no_debug_syntax(seq: Option<u64>, want: &str) {
        let f = VerifyFailure {
            location: "audit.log:7".into(),
            seq,
            why: "why".into(),
        };
        assert_eq!(f.to_string(), want);
    }

    #[test]
    fn forged_damage_is_not_explained() {
        // Garbage followed by a recovery checkpoint whose digest does not
        // match it: reported as the failure it is.
        let cp = Checkpoint {
            kind: "checkpoint".into(),
            seq: 0,
            prev: GENESIS.into(),
            time: "2026-01-01T00:00:00Z".into(),
            reason: "recovery".into(),
            records: 0,
            alg: "none".into(),
            key_id: None,
            sig: None,
            recovery: Some(Recovery {
                found: "unparsable_tail".into(),
                damaged_lines: 1,
                damaged_bytes: 8,
                damaged_sha256: "00".repeat(32),
                continued: false,
                last_line_bytes: None,
                old_file: None,
                old_head: None,
            }),
            replica: None,
            run: None,
            count: None,
            previous: None,
            shed: None,
        };
        let lines = vec![
            ("a:1".to_string(), b"garbage".to_vec()),
            ("a:2".to_string(), serde_json::to_vec(&cp).unwrap()),
        ];
        let f = verify_lines(&lines, None).unwrap_err();
        assert_eq!(f.location, "a:1");
        // With the right digest the same damage is explained and reported.
        let (bytes, sha) = damage_digest(&[b"garbage"]);
        let mut cp = cp;
        if let Some(r) = cp.recovery.as_mut() {
            r.damaged_bytes = bytes;
            r.damaged_sha256 = sha;
        }
        let lines = vec![
            lines[0].clone(),
            ("a:2".into(), serde_json::to_vec(&cp).unwrap()),
        ];
        let rep = verify_lines(&lines, None).unwrap();
        assert_eq!(rep.recoveries.len(), 1);
        assert!(rep.recoveries[0].damaged_lines_checked);
        assert_eq!(rep.chain_starts, 1);
    }

    #[test]
    fn log_lines_are_set_aside_and_audit_lines_kept() {
        let lines: Vec<(String, Vec<u8>)> = [
            "{\"type\":\"checkpoint\",\"seq\":0}",
            "2026-12-07T10:00:00Z  INFO meshca: listening",
            "{\"timestamp\":\"x\",\"level\":\"INFO\"}",
            "{\"type\":\"audit\",\"seq\":1}",
            " {\"type\":\"audit\",\"seq\":2}",
            "",
        ]
        .iter()
        .enumerate()
        .map(|(i, l)| (format!("log:{}", i + 1), l.as_bytes().to_vec()))
        .collect();
        let (kept, skipped) = audit_lines_only(lines);
        assert_eq!(skipped, 4);
        assert_eq!(
            kept.iter().map(|(loc, _)| loc.as_str()).collect::<Vec<_>>(),
            ["log:1", "log:4"],
            "locations stay those of the whole log"
        );
    }
}
