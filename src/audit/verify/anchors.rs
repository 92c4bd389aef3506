//! A log cross-checked against its anchors: the checkpoint lines the writer
//! published outside the pod (Kubernetes ConfigMaps, or files). Each anchor
//! must stand in the log byte for byte, and a replica's anchors, in the order
//! the API server stored them, must form one history.

use std::collections::{HashMap, HashSet};

use super::{VerifyFailure, VerifyReport};
use crate::audit::format::{line_hash, parse_line, Checkpoint, LineHead, Parsed};
use crate::audit::keys::{check_signature, VerifyKey};

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
    /// Why the object is not at the name and labels the checkpoint it
    /// holds gives (`None`: it is, or it is a file anchor); see
    /// `anchor::misplaced`. Such an object was not written by meshca.
    pub misplaced: Option<String>,
}

/// The order anchors were written in: the API server's creation time, then
/// seq within one second.
fn history_key(a: &Anchor, cp: &Checkpoint) -> (i64, u64) {
    (a.created.unwrap_or(i64::MIN), cp.seq)
}

/// The newest anchor (in history order) that is a checkpoint of `replica`.
/// A line stored again after its first copy is a replay (anyone who can
/// create ConfigMaps can store an older genuine line anew): it counts at
/// the time of its first copy, so it never becomes the newest.
pub fn newest_anchor<'a>(anchors: &'a [Anchor], replica: &str) -> Option<(Checkpoint, &'a Anchor)> {
    let mut first: HashMap<&str, i64> = HashMap::new();
    for a in anchors {
        let t = a.created.unwrap_or(i64::MIN);
        let e = first.entry(a.line.as_str()).or_insert(t);
        *e = (*e).min(t);
    }
    anchors
        .iter()
        .filter_map(|a| match parse_line(a.line.as_bytes()) {
            Ok(Parsed::Checkpoint(cp)) if cp.replica.as_deref() == Some(replica) => Some((*cp, a)),
            _ => None,
        })
        .max_by_key(|(cp, a)| {
            let at = first.get(a.line.as_str()).copied().unwrap_or(i64::MIN);
            (at, cp.seq)
        })
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
        // Checked before the replica: an object holding another replica's
        // genuine checkpoint at this replica's anchor names would otherwise
        // pass as that replica's anchor and hide the squat.
        if let Some(why) = &a.misplaced {
            return Err(fail(Some(cp.seq), why.clone()));
        }
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
    let mut by_seq: HashMap<u64, Vec<usize>> = Default::default();
    for (i, (_, l)) in lines.iter().enumerate() {
        if let Ok(h) = serde_json::from_slice::<LineHead>(l.as_ref()) {
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
    let mut first_at: HashMap<&str, usize> = Default::default();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::chain::{ChainedSink, Destination, RunInfo, SinkOptions};
    use crate::audit::format::PreviousHead;
    use crate::audit::verify::verify_lines;

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
            previous: previous.map(|(seq, hash, from)| PreviousHead {
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
            misplaced: None,
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
        let sink = ChainedSink::open(SinkOptions {
            run: RunInfo::new("meshca-0"),
            ..SinkOptions::new(Destination::Buffer)
        })
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

    /// A starting run's head: the newest anchor of its replica, where an
    /// older line stored again later counts at its first copy's time.
    #[test]
    fn a_replayed_older_anchor_is_not_the_newest() {
        let v = linked();
        let anchors: Vec<Anchor> = v.iter().map(|(_, a)| a.clone()).collect();
        let newest = |a: &[Anchor]| newest_anchor(a, "meshca-0").map(|(cp, _)| cp.seq);
        assert_eq!(newest(&anchors), Some(9));
        let mut replayed = anchors.clone();
        replayed.push(Anchor {
            source: "ns/replay".into(),
            created: Some(99),
            ..anchors[1].clone()
        });
        assert_eq!(
            newest(&replayed),
            Some(9),
            "the replay of seq 3 is not the head"
        );
        let mut other = anchor("rx", 50, "start", None, 99).1;
        other.line = other.line.replace("meshca-0", "meshca-1");
        replayed.push(other);
        assert_eq!(
            newest(&replayed),
            Some(9),
            "another replica's anchor is not"
        );
    }
}
