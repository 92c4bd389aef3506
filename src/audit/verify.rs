//! `meshca audit verify` and `meshca audit query`: reading the chained log.

use std::io::BufRead;
use std::path::Path;

use base64::Engine;
use serde::Deserialize;
use time::OffsetDateTime;

use super::bounded::{bounded, FIELD_MAX, SAN_MAX};
use super::chain::{line_hash, Checkpoint, Recovery, VerifyKey, GENESIS};
use super::{AuditRecord, Decision};
use std::collections::HashSet;

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

#[derive(Debug, Deserialize)]
struct Head {
    #[serde(rename = "type")]
    kind: String,
    seq: u64,
    prev: String,
}

/// One line, parsed as the writer writes it.
#[derive(Debug)]
pub(crate) enum Parsed {
    Audit {
        seq: u64,
        prev: String,
        record: Box<AuditRecord>,
    },
    Checkpoint(Box<Checkpoint>),
}

impl Parsed {
    pub(crate) fn seq(&self) -> u64 {
        match self {
            Self::Audit { seq, .. } => *seq,
            Self::Checkpoint(c) => c.seq,
        }
    }
    fn prev(&self) -> &str {
        match self {
            Self::Audit { prev, .. } => prev,
            Self::Checkpoint(c) => &c.prev,
        }
    }
}

/// Parses a line; the error carries the seq when the head was readable. The
/// writer uses the same test to find the last good line of a damaged log.
pub(crate) fn parse_line(line: &[u8]) -> Result<Parsed, (Option<u64>, String)> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Err((None, "empty line inserted".into()));
    }
    // The writer never pads a line; padding on the last line would escape
    // the hash chain, which only covers a line through its successor.
    // (Anything else around the object fails the JSON parse below.)
    if line.first().is_some_and(u8::is_ascii_whitespace)
        || line.last().is_some_and(u8::is_ascii_whitespace)
    {
        return Err((
            None,
            "whitespace around the line (edited: the writer never pads)".into(),
        ));
    }
    let head: Head = serde_json::from_slice(line).map_err(|e| {
        (
            None,
            format!("not a complete audit line (truncated or edited): {e}"),
        )
    })?;
    let seq = Some(head.seq);
    match head.kind.as_str() {
        "audit" => {
            let record = serde_json::from_slice::<AuditRecord>(line)
                .map_err(|e| (seq, format!("malformed audit record: {e}")))?;
            Ok(Parsed::Audit {
                seq: head.seq,
                prev: head.prev,
                record: Box::new(record),
            })
        }
        "checkpoint" => serde_json::from_slice::<Checkpoint>(line)
            .map(|c| Parsed::Checkpoint(Box::new(c)))
            .map_err(|e| (seq, format!("malformed checkpoint: {e}"))),
        other => Err((
            seq,
            format!("unknown line type \"{}\"", other.escape_debug()),
        )),
    }
}

/// SHA-256 and size of damaged lines as the writer commits to them: each
/// line's bytes followed by its newline.
pub(crate) fn damage_digest<L: AsRef<[u8]>>(lines: &[L]) -> (u64, String) {
    let mut ctx = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    let mut n = 0u64;
    for l in lines {
        ctx.update(l.as_ref());
        ctx.update(b"\n");
        n += l.as_ref().len() as u64 + 1;
    }
    (n, hex::encode(ctx.finish()))
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

/// Checks one checkpoint's signature against the key its `key_id` names.
fn check_signature(cp: &Checkpoint, keys: &[VerifyKey]) -> Result<bool, String> {
    if keys.is_empty() {
        return Ok(false);
    }
    let ids = || {
        keys.iter()
            .map(VerifyKey::key_id)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some(k) = keys
        .iter()
        .find(|k| cp.key_id.as_deref() == Some(k.key_id().as_str()))
    else {
        return Err(format!(
            "checkpoint names alg {} key {}, which is not among the given keys ({})",
            cp.alg,
            cp.key_id.as_deref().unwrap_or("(none)"),
            ids()
        ));
    };
    // v1 checkpoints do not sign `alg` and `key_id`: bind them to the key.
    if cp.alg != k.alg {
        return Err(format!(
            "checkpoint names alg {} for key {}, which is a {} key",
            cp.alg,
            k.key_id(),
            k.alg
        ));
    }
    let Some(sig) = &cp.sig else {
        return Err("checkpoint is not signed but a key was given".into());
    };
    let sig = base64::engine::general_purpose::STANDARD
        .decode(sig)
        .map_err(|_| "checkpoint signature is not base64".to_string())?;
    if !k.verify(&cp.message(), &sig) {
        return Err(format!(
            "checkpoint signature does not verify with key {} (the key it names)",
            k.key_id()
        ));
    }
    Ok(true)
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
type Head2 = (u64, String);

/// Checks a v2 checkpoint against the run it belongs to: a run begins with
/// its `start` (or the `recovery` right before it), never repeats, stays on
/// one replica, names the head it continues from, and counts its records.
fn check_run(
    cp: &Checkpoint,
    state: &mut Option<RunState>,
    seen: &mut HashSet<String>,
    report: &mut VerifyReport,
    (expected, tail): (Option<&Head2>, &[Head2]),
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

/// One anchored checkpoint as read back from outside the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Anchor {
    /// Where it came from (`namespace/name`, `file:line`).
    pub source: String,
    /// The checkpoint line, exactly as the writer wrote it.
    pub line: String,
    /// When the API server stored it (Unix seconds), which the pod cannot
    /// choose. `None` for an anchor given as a file: it is checked against
    /// the log but takes no part in the history checks.
    pub created: Option<i64>,
}

/// The order anchors were written in: the API server's creation time, then
/// seq within one second.
fn history_key(a: &Anchor, cp: &Checkpoint) -> (i64, u64) {
    (a.created.unwrap_or(i64::MIN), cp.seq)
}

/// The newest anchor (in history order) that is a checkpoint of `replica`.
pub fn newest_anchor<'a>(anchors: &'a [Anchor], replica: &str) -> Option<(Checkpoint, &'a Anchor)> {
    anchors
        .iter()
        .filter_map(|a| match parse_line(a.line.as_bytes()) {
            Ok(Parsed::Checkpoint(cp)) if cp.replica.as_deref() == Some(replica) => Some((*cp, a)),
            _ => None,
        })
        .max_by_key(|(cp, a)| history_key(a, cp))
}

/// What cross-checking against an anchor showed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnchorNote {
    /// Where the anchor came from (`namespace/name`, a file).
    pub source: String,
    pub replica: String,
    pub seq: u64,
    /// `file:line` of the matching checkpoint in the log.
    pub location: String,
}

/// How a log is cross-checked against anchors.
#[derive(Debug, Clone, Copy, Default)]
pub struct AnchorOptions<'a> {
    /// Keys anchors must be signed with (none: not checked).
    pub keys: &'a [VerifyKey],
    /// The anchors with a creation time are the cluster's whole anchor
    /// history (`--anchors`): the log's replica must have anchors there,
    /// and they must form one history.
    pub history: bool,
    /// The log may begin after some anchors (earlier files not given).
    pub partial: bool,
    /// Replicas that may have no anchor at all (`--partial=REPLICA`).
    pub unanchored: &'a [String],
    /// A new chain in a replica's anchor history is accepted.
    pub allow_new_chain: bool,
}

/// What a successful cross-check covered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AnchorReport {
    /// The log's replica (`None`: the log names none).
    pub replica: Option<String>,
    /// Anchors of the log's replica, and how many of them stand in the log.
    pub anchors: u64,
    pub matched: u64,
    /// Anchors before the log's first line (accepted by `partial`).
    pub before_log: u64,
    /// Anchors of other replicas (not checked against this log).
    pub other_replicas: u64,
    /// The newest anchor that stands in the log.
    pub newest: Option<AnchorNote>,
    /// Runs in the replica's anchor history.
    pub history_runs: u64,
    /// Accepted exceptions and other facts worth reporting.
    pub notes: Vec<String>,
    /// Start and shutdown checkpoints after the newest anchor: these are
    /// always anchored, so each means an anchor write failed for good, or
    /// the anchor was removed (`file:line`).
    pub unanchored_after: Vec<String>,
}

/// Cross-checks a log against anchored checkpoints (each the exact line the
/// writer published outside the pod). Every anchor must be a checkpoint
/// signed by one of `keys` (when given). Each anchor of the log's replica
/// must stand in the log byte for byte at its seq: a log that ends before it
/// was cut, a different line there means log and anchor disagree. With
/// `history`, the replica must have anchors, and its anchors in the order
/// the API server stored them must form one history ([`check_history`]).
pub fn check_anchors<L: AsRef<[u8]>>(
    lines: &[(String, L)],
    report: &VerifyReport,
    anchors: &[Anchor],
    opts: &AnchorOptions<'_>,
) -> Result<AnchorReport, VerifyFailure> {
    let log_replica = report.runs.first().map(|r| r.replica.clone());
    let mut out = AnchorReport {
        replica: log_replica.clone(),
        ..Default::default()
    };
    let mut mine: Vec<(Checkpoint, &Anchor)> = Vec::new();
    for a in anchors {
        let fail = |seq: Option<u64>, why: String| VerifyFailure {
            location: format!("anchor {}", a.source),
            seq,
            why,
        };
        let cp = match parse_line(a.line.as_bytes()) {
            Ok(Parsed::Checkpoint(cp)) => *cp,
            _ => {
                return Err(fail(
                    None,
                    "the anchor is not a checkpoint line (edited)".into(),
                ))
            }
        };
        check_signature(&cp, opts.keys)
            .map_err(|why| fail(Some(cp.seq), format!("anchor: {why}")))?;
        let replica = cp.replica.clone().unwrap_or_default();
        if log_replica.as_ref().is_some_and(|r| *r != replica) {
            out.other_replicas += 1;
            continue;
        }
        mine.push((cp, a));
    }
    out.anchors = mine.len() as u64;
    let mut history: Vec<&(Checkpoint, &Anchor)> =
        mine.iter().filter(|(_, a)| a.created.is_some()).collect();
    history.sort_by_key(|(cp, a)| history_key(a, cp));
    if opts.history {
        if let (true, Some(r)) = (history.is_empty(), &log_replica) {
            if !opts.unanchored.contains(r) {
                return Err(VerifyFailure {
                    location: "anchors".into(),
                    seq: None,
                    why: format!(
                        "replica {} has no anchor in the cluster: its anchors were removed, or it never anchored (--partial={} accepts that)",
                        r.escape_debug(),
                        r.escape_debug()
                    ),
                });
            }
            out.notes.push(format!(
                "replica {} has no anchor in the cluster (accepted by --partial)",
                r.escape_debug()
            ));
        }
        // One history per replica (several only when the log names none).
        let mut replicas: Vec<&str> = history
            .iter()
            .map(|(cp, _)| cp.replica.as_deref().unwrap_or(""))
            .collect();
        replicas.sort_unstable();
        replicas.dedup();
        for r in replicas {
            let one: Vec<&(Checkpoint, &Anchor)> = history
                .iter()
                .copied()
                .filter(|(cp, _)| cp.replica.as_deref().unwrap_or("") == r)
                .collect();
            let h =
                check_history(&one, opts.allow_new_chain).map_err(|(i, why)| VerifyFailure {
                    location: format!("anchor {}", one[i].1.source),
                    seq: Some(one[i].0.seq),
                    why,
                })?;
            out.history_runs += h.runs;
            out.notes.extend(h.notes);
        }
    }

    // Log lines by seq (a log may hold a seq twice: the crashed run's
    // orphaned tail, or a new chain the operator accepted).
    let mut by_seq: std::collections::HashMap<u64, Vec<usize>> = Default::default();
    for (i, (_, l)) in lines.iter().enumerate() {
        if let Ok(h) = serde_json::from_slice::<Head>(l.as_ref()) {
            by_seq.entry(h.seq).or_default().push(i);
        }
    }
    let (lo, hi) = (by_seq.keys().min().copied(), by_seq.keys().max().copied());
    // Index in `lines` of each matched anchor, in history order for cluster
    // anchors (files after them, by seq).
    let mut matched: Vec<(usize, &Anchor, &Checkpoint)> = Vec::new();
    let mut order: Vec<&(Checkpoint, &Anchor)> = history.clone();
    let mut files: Vec<&(Checkpoint, &Anchor)> =
        mine.iter().filter(|(_, a)| a.created.is_none()).collect();
    files.sort_by_key(|(cp, _)| cp.seq);
    order.extend(files);
    for (cp, a) in order {
        let fail = |why: String| VerifyFailure {
            location: format!("anchor {}", a.source),
            seq: Some(cp.seq),
            why,
        };
        let replica = cp.replica.clone().unwrap_or_default();
        match by_seq.get(&cp.seq) {
            Some(at) => match at.iter().find(|&&i| lines[i].1.as_ref() == a.line.as_bytes()) {
                Some(&i) => matched.push((i, a, cp)),
                None => {
                    let i = at[0];
                    return Err(VerifyFailure {
                        location: lines[i].0.clone(),
                        seq: Some(cp.seq),
                        why: format!(
                            "log and anchor {} disagree: the anchored checkpoint (line hash {}) is not this line (line hash {})",
                            a.source,
                            line_hash(&a.line),
                            line_hash(lines[i].1.as_ref())
                        ),
                    });
                }
            },
            None if hi.is_none_or(|hi| hi < cp.seq) => {
                return Err(fail(format!(
                    "replica {}'s anchor holds a checkpoint at seq {}, but the log ends at seq {}: the log was cut after it",
                    replica.escape_debug(),
                    cp.seq,
                    report.last_seq.map_or("-".into(), |s| s.to_string())
                )))
            }
            None if lo.is_some_and(|lo| cp.seq < lo) && opts.partial => out.before_log += 1,
            None if lo.is_some_and(|lo| cp.seq < lo) => {
                return Err(fail(
                    "the anchored checkpoint is before the log's first line: earlier files are missing (give them first, or --partial)"
                        .into(),
                ))
            }
            None => {
                return Err(fail(
                    "the anchored checkpoint's seq is not in the log: lines were removed".into(),
                ))
            }
        }
    }
    out.matched = matched.len() as u64;
    // The newest: the last in history order, else the file anchor furthest on.
    let newest = matched
        .iter()
        .rev()
        .find(|(_, a, _)| a.created.is_some())
        .or_else(|| matched.iter().max_by_key(|(i, _, _)| *i));
    if let Some(&(i, a, cp)) = newest {
        out.newest = Some(AnchorNote {
            source: a.source.clone(),
            replica: cp.replica.clone().unwrap_or_default(),
            seq: cp.seq,
            location: lines[i].0.clone(),
        });
        if opts.history && a.created.is_some() {
            for (location, l) in &lines[i + 1..] {
                if let Ok(Parsed::Checkpoint(c)) = parse_line(l.as_ref()) {
                    if c.reason == "start" || c.reason == "shutdown" {
                        out.unanchored_after.push(location.clone());
                    }
                }
            }
        }
    }
    Ok(out)
}

/// What a replica's anchor history showed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HistorySummary {
    pub runs: u64,
    pub notes: Vec<String>,
}

/// Checks one replica's anchors, in the order the API server stored them,
/// as one history: within a run the seq only grows; a new run begins with
/// its anchored start, which continues from the newest anchor before it
/// (or from a later line of the log file, after a crash). A rollback (a run
/// continuing from an older head, or an older anchor stored again), a
/// deleted anchor a run continued from, and a replaced history (a new chain
/// after anchors, unless `allow_new_chain`) fail with the index of the
/// anchor where it shows. Pruning removes only the oldest anchors, which
/// leaves the rest one history.
pub fn check_history(
    history: &[&(Checkpoint, &Anchor)],
    allow_new_chain: bool,
) -> Result<HistorySummary, (usize, String)> {
    let mut out = HistorySummary::default();
    let mut first_at: std::collections::HashMap<&str, usize> = Default::default();
    let mut runs: HashSet<&str> = HashSet::new();
    let mut prev: Option<usize> = None;
    for (i, (cp, a)) in history.iter().map(|x| (&x.0, x.1)).enumerate() {
        if let Some(&j) = first_at.get(a.line.as_str()) {
            if prev == Some(j) {
                // The same line stored twice in a row adds nothing.
                continue;
            }
            return Err((
                i,
                format!(
                    "this anchor repeats {} (seq {}) after newer anchors: an older head was anchored again (a rollback)",
                    history[j].1.source, cp.seq
                ),
            ));
        }
        first_at.insert(a.line.as_str(), i);
        let run = cp.run.as_deref().unwrap_or("");
        let Some(p) = prev else {
            prev = Some(i);
            runs.insert(run);
            out.runs = 1;
            if let Some(pr) = &cp.previous {
                out.notes.push(format!(
                    "the oldest anchor ({}) continues from seq {}, which no anchor holds (pruned, or written before anchoring began)",
                    a.source, pr.seq
                ));
            }
            continue;
        };
        prev = Some(i);
        let (pcp, pa) = (&history[p].0, history[p].1);
        let prun = pcp.run.as_deref().unwrap_or("");
        if run == prun {
            if cp.seq <= pcp.seq {
                return Err((
                    i,
                    format!(
                        "run {run}'s anchor at seq {} was stored after its anchor at seq {}: the replica's anchors went backwards",
                        cp.seq, pcp.seq
                    ),
                ));
            }
            continue;
        }
        if !runs.insert(run) {
            return Err((
                i,
                format!("run {run} is anchored again after run {prun}: two writers of one replica, or replayed anchors"),
            ));
        }
        out.runs += 1;
        if cp.reason != "start" && cp.reason != "recovery" {
            return Err((
                i,
                format!(
                    "the replica's anchors change from run {prun} (seq {}) to run {run} at a {} checkpoint: no anchored start links the new run to its predecessor",
                    pcp.seq,
                    cp.reason.escape_debug()
                ),
            ));
        }
        match &cp.previous {
            None if cp.seq > 0 => out.notes.push(format!(
                "run {run} ({}) begins a new chain segment after a recovery: the log's recovery checkpoint says why",
                a.source
            )),
            None if allow_new_chain => out.notes.push(format!(
                "run {run} ({}) starts a new chain after the replica's anchors reached seq {} (accepted by --allow-new-chain)",
                a.source, pcp.seq
            )),
            None => {
                return Err((
                    i,
                    format!(
                        "run {run} starts a new chain after the replica's anchors reached seq {} in run {prun}: its history was replaced (--allow-new-chain accepts it when the operator knows why)",
                        pcp.seq
                    ),
                ))
            }
            Some(pr) if pr.seq < pcp.seq => {
                return Err((
                    i,
                    format!(
                        "run {run} continues from seq {}, but the replica's anchors had already reached seq {} (run {prun}): its history was rolled back",
                        pr.seq, pcp.seq
                    ),
                ))
            }
            Some(pr) if pr.seq == pcp.seq && pr.hash != line_hash(&pa.line) => {
                return Err((
                    i,
                    format!(
                        "run {run} continues from seq {} (line hash {}), but the replica's anchor at that seq is another line (line hash {}): a forked history",
                        pr.seq,
                        pr.hash.escape_debug(),
                        line_hash(&pa.line)
                    ),
                ))
            }
            Some(pr) if pr.seq > pcp.seq && pr.from == "anchor" => {
                return Err((
                    i,
                    format!(
                        "run {run} continued from an anchored checkpoint at seq {}, which is not among the replica's anchors (the newest before it is seq {}): an anchor was removed",
                        pr.seq, pcp.seq
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(out)
}

/// The chain broke between lines `i-1` and `i` with no gap in `seq`: one of
/// the two was edited. If line `i+1` still links to line `i`, line `i` is
/// intact and the previous line was changed; otherwise line `i`'s own `prev`
/// was altered.
fn blame_edit<L: AsRef<[u8]>>(lines: &[(String, L)], i: usize, seq: u64) -> VerifyFailure {
    let next_links = lines
        .get(i + 1)
        .and_then(|(_, next)| serde_json::from_slice::<Head>(next.as_ref()).ok())
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
            Box::new(std::io::BufReader::new(std::fs::File::open(p)?))
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

/// Filters for `meshca audit query`; every set field must match.
#[derive(Debug, Clone, Default)]
pub struct Query {
    /// Matches the requested identity, the caller identity or a CSR SAN.
    pub identity: Option<String>,
    /// Matches the record's node, and (through [`query`]) every record of a
    /// caller presenting a certificate descended from one issued on the node.
    pub node: Option<String>,
    /// Matches the caller identity or the caller pod (`ns/name`).
    pub caller: Option<String>,
    pub decision: Option<Decision>,
    pub reason: Option<String>,
    pub since: Option<OffsetDateTime>,
    pub until: Option<OffsetDateTime>,
    /// Compare identities in canonical form (alias trust domains resolved
    /// to the mesh one), as authorization does.
    pub trust_domains: Option<crate::identity::TrustDomains>,
}

impl Query {
    /// Whether `r` matches, its node compared as written.
    pub fn matches(&self, r: &AuditRecord) -> bool {
        self.matches_in(r, None)
    }

    /// Whether `r` matches; with `lineage`, a record whose presented
    /// certificate is in it matches the node too.
    fn matches_in(&self, r: &AuditRecord, lineage: Option<&HashSet<String>>) -> bool {
        let eq = |want: &Option<String>, got: &Option<String>| {
            want.as_ref()
                .is_none_or(|w| got.as_deref() == Some(w.as_str()))
        };
        let canon = |s: &str| match &self.trust_domains {
            Some(tds) => tds.canonical_str(s),
            None => s.to_string(),
        };
        self.identity.as_ref().is_none_or(|i| {
            // Records hold bounded values; bounding the query the same way
            // (deterministic) lets an oversized value match by its hash.
            let field = bounded(i, FIELD_MAX);
            let san = bounded(i, SAN_MAX);
            let (field, san) = (canon(&field), canon(&san));
            r.requested_identity.as_deref().map(canon) == Some(field.clone())
                || r.caller_identity.as_deref().map(canon) == Some(field)
                || r.csr_sans.iter().flatten().any(|s| canon(s) == san)
        }) && (eq(&self.node, &r.node)
            || lineage.is_some_and(|l| {
                r.presented_serial.as_ref().is_some_and(|s| l.contains(s))
                    || r.serial.as_ref().is_some_and(|s| {
                        l.contains(s) && r.decision == Decision::Allow && r.reason == "issued"
                    })
            }))
            && self.caller.as_ref().is_none_or(|c| {
                r.caller_identity.as_deref() == Some(c) || r.caller_pod.as_deref() == Some(c)
            })
            && self.decision.is_none_or(|d| d == r.decision)
            && eq(&self.reason, &Some(r.reason.clone()))
            && self.since.is_none_or(|t| r.time >= t)
            && self.until.is_none_or(|t| r.time <= t)
    }
}

/// Certificates issued to the holders of other certificates: each mTLS
/// record names the certificate presented (`presented_serial`), so a leaf
/// leads to its renewals, theirs to their own, and so on.
#[derive(Debug, Default)]
pub struct Lineage<'a> {
    /// Serial -> its issuance record.
    issued: std::collections::HashMap<&'a str, &'a AuditRecord>,
    /// Presented serial -> serials issued to its holder.
    children: std::collections::HashMap<&'a str, Vec<&'a str>>,
}

/// One certificate reached by [`Lineage::descendants`].
#[derive(Debug, Clone, PartialEq)]
pub struct Descendant<'a> {
    pub serial: &'a str,
    /// Its issuance record, when the log has it.
    pub record: Option<&'a AuditRecord>,
    /// Its own node, else the nearest ancestor's: where the key it was
    /// renewed from was issued.
    pub node: Option<&'a str>,
    /// Its own cluster, else the nearest ancestor's.
    pub cluster_id: Option<&'a str>,
}

impl<'a> Lineage<'a> {
    /// The lineage of the `issued` records among `records`.
    pub fn new(records: &'a [AuditRecord]) -> Self {
        let mut l = Self::default();
        for r in records {
            let Some(serial) = r.serial.as_deref() else {
                continue;
            };
            if r.decision != Decision::Allow || r.reason != "issued" {
                continue;
            }
            l.issued.entry(serial).or_insert(r);
            if let Some(parent) = r.presented_serial.as_deref() {
                l.children.entry(parent).or_default().push(serial);
            }
        }
        l
    }

    /// The issuance record of `serial`.
    pub fn issued(&self, serial: &str) -> Option<&'a AuditRecord> {
        self.issued.get(serial).copied()
    }

    /// `roots` and every certificate descended from them, each once, in
    /// breadth-first order; a certificate whose own record names no node
    /// (or cluster) carries its nearest ancestor's (an mTLS renewal's
    /// record names none).
    pub fn descendants<'r>(&self, roots: impl IntoIterator<Item = &'r str>) -> Vec<Descendant<'a>> {
        let mut out: Vec<Descendant<'a>> = Vec::new();
        let mut seen: HashSet<String> = HashSet::new();
        let mut queue: std::collections::VecDeque<String> =
            roots.into_iter().map(str::to_string).collect();
        while let Some(serial) = queue.pop_front() {
            if !seen.insert(serial.clone()) {
                continue;
            }
            let record = self.issued.get(serial.as_str()).copied();
            let key: &'a str = match (
                record.and_then(|r| r.serial.as_deref()),
                self.children.get_key_value(serial.as_str()),
            ) {
                (Some(k), _) => k,
                // Not issued in this log (rotated away, or an outside
                // serial): it may still have children here.
                (None, Some((k, _))) => k,
                (None, None) => continue,
            };
            if let Some(r) = record {
                out.push(Descendant {
                    serial: key,
                    record: Some(r),
                    node: self.inherited(r, |r| r.node.as_deref()),
                    cluster_id: self.inherited(r, |r| r.cluster_id.as_deref()),
                });
            }
            for child in self.children.get(key).into_iter().flatten() {
                queue.push_back(child.to_string());
            }
        }
        out
    }

    /// `field` of `r`, else of the certificate its caller presented, and so
    /// on up the chain (bounded: a log cannot make it loop).
    fn inherited(
        &self,
        mut r: &'a AuditRecord,
        field: impl Fn(&'a AuditRecord) -> Option<&'a str>,
    ) -> Option<&'a str> {
        for _ in 0..=self.issued.len() {
            if let Some(v) = field(r) {
                return Some(v);
            }
            r = self.issued(r.presented_serial.as_deref()?)?;
        }
        None
    }
}

/// The audit records among `lines` that match `q` (checkpoints skipped),
/// and the locations of lines that could not be read as records (damaged
/// lines a recovery names, or tampering: `audit verify` tells which).
/// With `q.node`, certificates renewed over mTLS from one issued on that
/// node count as the node's: their issuance records and every record of a
/// caller presenting them match.
pub fn query<L: AsRef<[u8]>>(lines: &[(String, L)], q: &Query) -> (Vec<AuditRecord>, Vec<String>) {
    let mut all = Vec::new();
    let mut unreadable = Vec::new();
    for (location, line) in lines {
        match parse_line(line.as_ref()) {
            Ok(Parsed::Audit { record, .. }) => all.push(*record),
            Ok(_) => {}
            Err(_) => unreadable.push(location.clone()),
        }
    }
    let lineage = q.node.as_ref().map(|n| {
        let l = Lineage::new(&all);
        let roots: Vec<&str> = all
            .iter()
            .filter(|r| r.node.as_deref() == Some(n.as_str()))
            .filter(|r| r.decision == Decision::Allow && r.reason == "issued")
            .filter_map(|r| r.serial.as_deref())
            .collect();
        l.descendants(roots)
            .into_iter()
            .map(|d| d.serial.to_string())
            .collect::<HashSet<String>>()
    });
    let out = all
        .into_iter()
        .filter(|r| q.matches_in(r, lineage.as_ref()))
        .collect();
    (out, unreadable)
}

/// A fixed-width table of records.
pub fn table(records: &[AuditRecord]) -> String {
    let mut rows = vec![[
        "TIME",
        "DECISION",
        "REASON",
        "CALLER",
        "REQUESTED",
        "CSR SANS",
        "NODE",
        "SERIAL",
    ]
    .map(String::from)
    .to_vec()];
    for r in records {
        rows.push(vec![
            r.time
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
            match r.decision {
                Decision::Allow => "allow".into(),
                Decision::Deny => "deny".into(),
            },
            r.reason.clone(),
            r.caller_identity
                .clone()
                .or_else(|| r.peer.clone())
                .unwrap_or_else(|| "-".into()),
            r.requested_identity.clone().unwrap_or_else(|| "-".into()),
            r.csr_sans
                .as_ref()
                .filter(|s| !s.is_empty())
                .map(|s| s.join(","))
                .unwrap_or_else(|| "-".into()),
            r.node.clone().unwrap_or_else(|| "-".into()),
            r.serial.clone().unwrap_or_else(|| "-".into()),
        ]);
    }
    crate::table::render_table(&rows)
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
    fn an_oversized_identity_is_found_by_its_raw_value() {
        let huge = format!("spiffe://cluster.local/ns/{}", "\u{1}".repeat(100_000));
        let mut r: AuditRecord = serde_json::from_str(
            r#"{"time":"2026-01-01T00:00:00Z","request_id":"r","peer":null,"authn_method":null,
            "caller_identity":null,"caller_pod":null,"caller_pod_uid":null,"node":null,
            "requested_identity":null,"impersonated":true,"decision":"deny","reason":"x",
            "detail":null,"evidence":null,"serial":null,"spki_sha256":null,"csr_sha256":null,
            "not_before":null,"not_after":null,"issuer_key_id":null,"latency_ms":1.0}"#,
        )
        .unwrap();
        r.requested_identity = Some(huge.clone());
        r.csr_sans = Some(vec!["spiffe://a/b".into(), huge.clone()]);
        r.bound();
        let q = |id: &str| Query {
            identity: Some(id.into()),
            ..Default::default()
        };
        assert!(q(&huge).matches(&r));
        assert!(q("spiffe://a/b").matches(&r));
        assert!(!q(&format!("{huge}x")).matches(&r));
        r.requested_identity = None;
        assert!(q(&huge).matches(&r), "through the bounded SAN");
    }

    /// A checkpoint line of `run` (unsigned) and its anchor stored at `created`.
    fn anchor(
        run: &str,
        seq: u64,
        reason: &str,
        previous: Option<(u64, &str, &str)>,
        created: i64,
    ) -> (Checkpoint, Anchor) {
        let cp = Checkpoint {
            kind: "checkpoint".into(),
            seq,
            prev: "p".into(),
            time: "2026-01-01T00:00:00Z".into(),
            reason: reason.into(),
            records: 0,
            alg: "none".into(),
            key_id: None,
            sig: None,
            recovery: None,
            replica: Some("meshca-0".into()),
            run: Some(run.into()),
            count: Some(0),
            previous: previous.map(|(seq, hash, from)| crate::audit::chain::PreviousHead {
                seq,
                hash: hash.into(),
                from: from.into(),
            }),
            shed: Some(0),
        };
        let line = serde_json::to_string(&cp).unwrap();
        let a = Anchor {
            source: format!("ns/{run}.{seq}.{created}"),
            line,
            created: Some(created),
        };
        (cp, a)
    }

    /// Run 1 (start at 0, shutdown at 3), then run 2 continuing from it.
    fn linked() -> Vec<(Checkpoint, Anchor)> {
        let r1 = vec![
            anchor("r1", 0, "start", None, 10),
            anchor("r1", 3, "shutdown", None, 20),
        ];
        let h = line_hash(&r1[1].1.line);
        let mut v = r1;
        v.push(anchor("r2", 4, "start", Some((3, &h, "anchor")), 30));
        v.push(anchor("r2", 8, "periodic", None, 40));
        v.push(anchor("r2", 9, "shutdown", None, 50));
        v
    }

    fn history_of(v: &[(Checkpoint, Anchor)], allow: bool) -> Result<HistorySummary, String> {
        let mut refs: Vec<(Checkpoint, &Anchor)> = v.iter().map(|(c, a)| (c.clone(), a)).collect();
        refs.sort_by_key(|(c, a)| history_key(a, c));
        let h: Vec<&(Checkpoint, &Anchor)> = refs.iter().collect();
        check_history(&h, allow).map_err(|(_, why)| why)
    }

    #[test]
    fn anchor_histories() {
        let ok = |v: Vec<(Checkpoint, Anchor)>| history_of(&v, false).unwrap();
        let fails = |v: Vec<(Checkpoint, Anchor)>, want: &str| {
            let e = history_of(&v, false).unwrap_err();
            assert!(e.contains(want), "{e}\nwanted: {want}");
        };
        assert_eq!(ok(linked()).runs, 2);

        // Within a run the seq only grows.
        let mut v = linked();
        v.push(anchor("r2", 7, "periodic", None, 60));
        fails(v, "the replica's anchors went backwards");

        // An older genuine anchor stored again after newer ones.
        let mut v = linked();
        let old = v[1].clone();
        v.push((
            old.0,
            Anchor {
                source: "ns/copy".into(),
                created: Some(60),
                ..old.1
            },
        ));
        fails(v, "an older head was anchored again (a rollback)");

        // A run continuing from an older head than the newest anchor.
        let mut v = linked();
        let h = line_hash(&v[1].1.line);
        v.push(anchor("r3", 4, "start", Some((3, &h, "anchor")), 60));
        fails(v, "its history was rolled back");

        // At the newest anchor's seq, but another line there.
        let mut v = linked();
        v.push(anchor("r3", 10, "start", Some((9, "00", "anchor")), 60));
        fails(v, "a forked history");

        // A new chain after anchors: replaced, unless the operator says why.
        let mut v = linked();
        v.push(anchor("r3", 0, "start", None, 60));
        fails(v.clone(), "its history was replaced");
        let h = history_of(&v, true).unwrap();
        assert!(
            h.notes[0].contains("accepted by --allow-new-chain"),
            "{:?}",
            h.notes
        );
        // A new segment after a recovery (seq > 0, no predecessor) is the
        // log's recovery checkpoint to explain.
        let mut v = linked();
        v.push(anchor("r3", 1, "start", None, 60));
        assert!(ok(v).notes[0].contains("after a recovery"));

        // Another run's anchors without its start.
        let mut v = linked();
        v.push(anchor("r3", 12, "periodic", None, 60));
        fails(v, "no anchored start links the new run");

        // The anchor a run continued from is gone.
        let mut v = linked();
        v.remove(1);
        fails(v, "an anchor was removed");

        // After a crash a file-sink run continues from the file's last line,
        // past the newest anchor.
        let mut v = linked();
        v.push(anchor("r3", 14, "start", Some((13, "ff", "file")), 60));
        assert_eq!(ok(v).runs, 3);

        // Runs do not interleave.
        let mut v = linked();
        v.push(anchor("r1", 20, "periodic", None, 60));
        fails(v, "run r1 is anchored again after run r2");

        // The same line stored twice in a row adds nothing.
        let mut v = linked();
        let last = v[4].clone();
        v.push((
            last.0,
            Anchor {
                source: "ns/dup".into(),
                created: Some(50),
                ..last.1
            },
        ));
        assert_eq!(ok(v).runs, 2);

        // Pruned: the oldest kept anchor continues from one that is gone.
        let v = linked()[2..].to_vec();
        assert!(ok(v).notes[0].contains("which no anchor holds (pruned"));

        // Stored in the same second: the seq orders them.
        let mut v = linked();
        for (_, a) in &mut v {
            a.created = Some(10);
        }
        assert_eq!(ok(v).runs, 2);
    }

    fn unanchored_log() -> (Vec<(String, String)>, VerifyReport) {
        let sink = crate::audit::chain::ChainedSink::writer_linked(
            crate::audit::chain::Output::Buffer(Vec::new()),
            None,
            1000,
            16384,
            crate::audit::chain::RunInfo::new("meshca-0"),
            None,
        )
        .unwrap();
        sink.checkpoint("shutdown").unwrap();
        let lines: Vec<(String, String)> = sink
            .buffer_contents()
            .lines()
            .enumerate()
            .map(|(i, l)| (format!("log:{}", i + 1), l.to_string()))
            .collect();
        let report = verify_lines(&lines, None).unwrap();
        (lines, report)
    }

    #[test]
    fn a_replica_without_anchors_fails_unless_named() {
        let (lines, report) = unanchored_log();
        // Another replica's anchor is no anchor of this one.
        let mut other = anchor("rx", 0, "start", None, 10);
        other.1.line = other.1.line.replace("meshca-0", "meshca-1");
        let anchors = [other.1];
        let opts = AnchorOptions {
            history: true,
            ..Default::default()
        };
        let e = check_anchors(&lines, &report, &anchors, &opts).unwrap_err();
        assert!(e.why.contains("replica meshca-0 has no anchor"), "{e}");
        let named = ["meshca-0".to_string()];
        let r = check_anchors(
            &lines,
            &report,
            &anchors,
            &AnchorOptions {
                unanchored: &named,
                ..opts
            },
        )
        .unwrap();
        assert_eq!((r.anchors, r.other_replicas), (0, 1));
        // Without the history (files only) nothing is required.
        check_anchors(&lines, &report, &anchors, &AnchorOptions::default()).unwrap();
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
}
