//! `meshca audit verify` and `meshca audit query`: reading the chained log.

use std::io::BufRead;
use std::path::Path;

use base64::Engine;
use serde::Deserialize;
use time::OffsetDateTime;

use super::chain::{line_hash, Checkpoint, VerifyKey, GENESIS};
use super::{AuditRecord, Decision};

/// Where verification first failed, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{location} (seq {seq:?}): {why}")]
pub struct VerifyFailure {
    /// `file:line`.
    pub location: String,
    pub seq: Option<u64>,
    pub why: String,
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
}

#[derive(Debug, Deserialize)]
struct Head {
    #[serde(rename = "type")]
    kind: String,
    seq: u64,
    prev: String,
}

/// Verifies lines in order (one or more files, oldest first). With `key`,
/// every checkpoint must carry a valid signature by it.
pub fn verify_lines(
    lines: &[(String, String)],
    key: Option<&VerifyKey>,
) -> Result<VerifyReport, VerifyFailure> {
    let mut report = VerifyReport::default();
    let mut expected: Option<(u64, String)> = None;
    for (i, (location, line)) in lines.iter().enumerate() {
        let fail = |seq: Option<u64>, why: String| VerifyFailure {
            location: location.clone(),
            seq,
            why,
        };
        if line.trim().is_empty() {
            return Err(fail(None, "empty line inserted".into()));
        }
        let head: Head = serde_json::from_str(line).map_err(|e| {
            fail(
                None,
                format!("not a complete audit line (truncated or edited): {e}"),
            )
        })?;
        let seq = Some(head.seq);
        let checkpoint = match head.kind.as_str() {
            "audit" => {
                serde_json::from_str::<AuditRecord>(line)
                    .map_err(|e| fail(seq, format!("malformed audit record: {e}")))?;
                None
            }
            "checkpoint" => Some(
                serde_json::from_str::<Checkpoint>(line)
                    .map_err(|e| fail(seq, format!("malformed checkpoint: {e}")))?,
            ),
            other => return Err(fail(seq, format!("unknown line type {other:?}"))),
        };
        if let Some(cp) = &checkpoint {
            match (key, &cp.sig) {
                (Some(k), Some(sig)) => {
                    let sig = base64::engine::general_purpose::STANDARD
                        .decode(sig)
                        .map_err(|_| fail(seq, "checkpoint signature is not base64".into()))?;
                    if !k.verify(&cp.message(), &sig) {
                        return Err(fail(
                            seq,
                            "checkpoint signature does not verify with the given key".into(),
                        ));
                    }
                    report.signed_checkpoints += 1;
                }
                (Some(_), None) => {
                    return Err(fail(
                        seq,
                        "checkpoint is not signed but a key was given".into(),
                    ))
                }
                (None, _) => {}
            }
        }
        // A (verified) start checkpoint at genesis begins a new chain.
        let fresh_start = checkpoint
            .as_ref()
            .is_some_and(|cp| cp.reason == "start" && cp.seq == 0 && cp.prev == GENESIS);
        match &expected {
            _ if fresh_start => report.chain_starts += 1,
            None => {
                let genesis = head.seq == 0 && head.prev == GENESIS;
                if !genesis && checkpoint.is_none() {
                    return Err(fail(seq, "log does not begin at the chain's start or at a checkpoint: earlier records were removed".into()));
                }
            }
            Some((want_seq, want_prev)) => {
                if head.seq != *want_seq {
                    return Err(fail(seq, format!("expected seq {want_seq}: records were removed or reordered before this line")));
                }
                if head.prev != *want_prev {
                    return Err(blame_edit(lines, i, head.seq));
                }
            }
        }
        report.first_seq.get_or_insert(head.seq);
        report.last_seq = Some(head.seq);
        if checkpoint.is_some() {
            report.checkpoints += 1;
            report.unsigned_tail = 0;
        } else {
            report.records += 1;
            report.unsigned_tail += 1;
        }
        expected = Some((head.seq + 1, line_hash(line)));
    }
    Ok(report)
}

/// The chain broke between lines `i-1` and `i` with no gap in `seq`: one of
/// the two was edited. If line `i+1` still links to line `i`, line `i` is
/// intact and the previous line was changed; otherwise line `i`'s own `prev`
/// was altered.
fn blame_edit(lines: &[(String, String)], i: usize, seq: u64) -> VerifyFailure {
    let next_links = lines
        .get(i + 1)
        .and_then(|(_, next)| serde_json::from_str::<Head>(next).ok())
        .map(|h| h.prev == line_hash(&lines[i].1));
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

/// Reads `paths` in order (`-` is standard input) as `(file:line, text)`.
pub fn read_lines(paths: &[impl AsRef<Path>]) -> std::io::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for p in paths {
        let p = p.as_ref();
        let reader: Box<dyn BufRead> = if p == Path::new("-") {
            Box::new(std::io::BufReader::new(std::io::stdin()))
        } else {
            Box::new(std::io::BufReader::new(std::fs::File::open(p)?))
        };
        for (i, line) in reader.lines().enumerate() {
            out.push((format!("{}:{}", p.display(), i + 1), line?));
        }
    }
    Ok(out)
}

/// Filters for `meshca audit query`; every set field must match.
#[derive(Debug, Clone, Default)]
pub struct Query {
    /// Matches the requested or the caller identity.
    pub identity: Option<String>,
    pub node: Option<String>,
    /// Matches the caller identity or the caller pod (`ns/name`).
    pub caller: Option<String>,
    pub decision: Option<Decision>,
    pub reason: Option<String>,
    pub since: Option<OffsetDateTime>,
    pub until: Option<OffsetDateTime>,
}

impl Query {
    pub fn matches(&self, r: &AuditRecord) -> bool {
        let eq = |want: &Option<String>, got: &Option<String>| {
            want.as_ref()
                .is_none_or(|w| got.as_deref() == Some(w.as_str()))
        };
        self.identity.as_ref().is_none_or(|i| {
            r.requested_identity.as_deref() == Some(i) || r.caller_identity.as_deref() == Some(i)
        }) && eq(&self.node, &r.node)
            && self.caller.as_ref().is_none_or(|c| {
                r.caller_identity.as_deref() == Some(c) || r.caller_pod.as_deref() == Some(c)
            })
            && self.decision.is_none_or(|d| d == r.decision)
            && eq(&self.reason, &Some(r.reason.clone()))
            && self.since.is_none_or(|t| r.time >= t)
            && self.until.is_none_or(|t| r.time <= t)
    }
}

/// The audit records among `lines` that match `q` (checkpoints skipped).
pub fn query(lines: &[(String, String)], q: &Query) -> Result<Vec<AuditRecord>, VerifyFailure> {
    let mut out = Vec::new();
    for (location, line) in lines {
        let head: Head = serde_json::from_str(line).map_err(|e| VerifyFailure {
            location: location.clone(),
            seq: None,
            why: format!("not an audit line: {e}"),
        })?;
        if head.kind != "audit" {
            continue;
        }
        let r: AuditRecord = serde_json::from_str(line).map_err(|e| VerifyFailure {
            location: location.clone(),
            seq: Some(head.seq),
            why: e.to_string(),
        })?;
        if q.matches(&r) {
            out.push(r);
        }
    }
    Ok(out)
}

/// A fixed-width table of records.
pub fn table(records: &[AuditRecord]) -> String {
    let mut rows = vec![[
        "TIME",
        "DECISION",
        "REASON",
        "CALLER",
        "REQUESTED",
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
            r.node.clone().unwrap_or_else(|| "-".into()),
            r.serial.clone().unwrap_or_else(|| "-".into()),
        ]);
    }
    crate::certs::render_table(&rows)
}
