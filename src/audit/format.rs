//! The audit log's line format, shared by the writer ([`super::chain`]) and
//! the verifier ([`super::verify`]): audit and checkpoint lines, the chain's
//! start ([`GENESIS`]), line hashes, the bytes a checkpoint signature covers,
//! how a record over the line cap is reduced, and the parser both sides use to tell a good line from a damaged one.

use serde::{Deserialize, Serialize};

use super::bounded::{bound_opt, bound_string, MIN_MAX};
use super::{AuditError, AuditRecord, Reduced};
use crate::primitives::sha256;

/// `prev` of the first record of a chain.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// One audit line: the record plus its chain position.
#[derive(Debug, Serialize)]
struct AuditLine<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    seq: u64,
    prev: &'a str,
    #[serde(flatten)]
    record: &'a AuditRecord,
}

/// A checkpoint line. Unknown members are refused: the last checkpoint is
/// covered only by its signature, and a renamed member (say `shed`) would
/// otherwise read as absent and sign the same as its default.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    #[serde(rename = "type")]
    pub kind: String,
    pub seq: u64,
    pub prev: String,
    pub time: String,
    /// `start`, `periodic`, `rotation` or `shutdown`.
    pub reason: String,
    /// Audit records written by this process so far.
    pub records: u64,
    pub alg: String,
    pub key_id: Option<String>,
    pub sig: Option<String>,
    /// Present on `recovery` checkpoints: what damage was found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<Recovery>,
    // Format v2 (all present together; signed with alg and key_id): which
    // replica and run wrote the checkpoint, how many records since the
    // previous checkpoint, the run's predecessor, and requests shed.
    /// The replica (pod name) whose log this is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<String>,
    /// Random id of this process run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    /// Audit records written since this run's previous checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    /// On a run's `start` checkpoint: the head the run continues from (the
    /// previous run's last line), when one was known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<PreviousHead>,
    /// Requests this run refused because the audit writer could not take
    /// their record (no certificate left for them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shed: Option<u64>,
}

/// The head a run continues from: the seq and line hash of the previous
/// run's last line (read from the file, or from the anchor for stdout).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PreviousHead {
    pub seq: u64,
    pub hash: String,
    /// Where it was read from: `file` or `anchor`.
    pub from: String,
}

/// What a `recovery` checkpoint says about the damage it follows. Damaged
/// lines are never removed: they stay in the log, and this names them by
/// count, size and SHA-256 (each line with its newline) so `audit verify`
/// can tell recorded damage from tampering.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Recovery {
    /// `torn_line`, `unparsable_tail`, `oversize_line` or `write_error`.
    pub found: String,
    /// Damaged lines right before this checkpoint (or at the end of
    /// `old_file` for a new segment).
    pub damaged_lines: u64,
    pub damaged_bytes: u64,
    pub damaged_sha256: String,
    /// `true`: the chain continues from the last good line. `false`: this
    /// checkpoint starts a new segment (seq 0) because no good line was found.
    pub continued: bool,
    /// Size of the last line when it was over the line cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_line_bytes: Option<u64>,
    /// New segment: the file the damaged log was moved to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_file: Option<String>,
    /// New segment: SHA-256 of the damaged log's last line (its old head).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_head: Option<String>,
}

impl Checkpoint {
    /// The bytes a checkpoint signature covers. v2 (a checkpoint naming
    /// its run) also covers alg, key_id, replica, run, count, previous and
    /// shed, so none of them can be edited or swapped.
    pub fn message(&self) -> Vec<u8> {
        let mut m = format!(
            "meshca-audit-checkpoint-v1\n{}\n{}\n{}\n{}\n{}",
            self.seq, self.prev, self.time, self.reason, self.records
        );
        if let Some(run) = &self.run {
            m = format!(
                "meshca-audit-checkpoint-v2\n{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}",
                self.seq,
                self.prev,
                self.time,
                self.reason,
                self.records,
                self.alg,
                self.key_id.as_deref().unwrap_or("-"),
                serde_json::to_string(&self.replica).unwrap_or_default(),
                serde_json::to_string(run).unwrap_or_default(),
                self.count.unwrap_or(0),
                serde_json::to_string(&self.previous).unwrap_or_default(),
                self.shed.unwrap_or(0),
            );
        }
        if let Some(r) = &self.recovery {
            m.push_str("\nrecovery ");
            m.push_str(&serde_json::to_string(r).unwrap_or_default());
        }
        m.into_bytes()
    }
}

/// The audit line for `record` at chain position (`seq`, `prev`), within
/// `max_line_bytes`: the full record, or else a reduced form that says so
/// (strings cut hard, and the full line's size and hash), or else only the
/// decision.
pub(crate) fn fit_line(
    seq: u64,
    prev: &str,
    record: &AuditRecord,
    max_line_bytes: u64,
) -> Result<String, AuditError> {
    let render = |record: &AuditRecord| {
        serde_json::to_string(&AuditLine {
            kind: "audit",
            seq,
            prev,
            record,
        })
        .map_err(|e| AuditError(e.to_string()))
    };
    let cap = max_line_bytes as usize;
    let line = render(record)?;
    if line.len() < cap {
        return Ok(line);
    }
    let mut reduced = record.clone();
    reduced.reduced = Some(Reduced {
        line_bytes: line.len() as u64,
        line_sha256: line_hash(&line),
        max_line_bytes,
    });
    bound_string(&mut reduced.request_id, MIN_MAX);
    bound_string(&mut reduced.reason, MIN_MAX);
    for f in [
        &mut reduced.peer,
        &mut reduced.authn_method,
        &mut reduced.caller_identity,
        &mut reduced.caller_pod,
        &mut reduced.caller_pod_uid,
        &mut reduced.node,
        &mut reduced.requested_identity,
        &mut reduced.detail,
        &mut reduced.evidence,
        &mut reduced.serial,
        &mut reduced.spki_sha256,
        &mut reduced.csr_sha256,
        &mut reduced.issuer_key_id,
    ] {
        bound_opt(f, MIN_MAX);
    }
    if let Some(sans) = &mut reduced.csr_sans {
        sans.truncate(1);
        sans.iter_mut().for_each(|s| bound_string(s, MIN_MAX));
    }
    let line = render(&reduced)?;
    if line.len() < cap {
        return Ok(line);
    }
    let minimal = AuditRecord {
        impersonated: reduced.impersonated,
        lifetime: reduced.lifetime,
        latency_ms: reduced.latency_ms,
        reduced: reduced.reduced,
        ..AuditRecord::new(
            reduced.time,
            String::new(),
            reduced.decision,
            reduced.reason.chars().take(64).collect(),
        )
    };
    let line = render(&minimal)?;
    if line.len() < cap {
        return Ok(line);
    }
    Err(AuditError(format!(
        "audit record does not fit the {cap} byte line cap even reduced"
    )))
}

/// Hex SHA-256 of a line (without its newline).
pub fn line_hash(line: impl AsRef<[u8]>) -> String {
    hex::encode(sha256(line.as_ref()))
}

/// The seq of a line from its first bytes, as the writer lays them out
/// ([`AuditLine`] and [`Checkpoint`] serialize `type`, `seq`, `prev` first).
pub(crate) fn head_seq(head: &[u8]) -> Option<u64> {
    let rest = [
        &b"{\"type\":\"audit\",\"seq\":"[..],
        b"{\"type\":\"checkpoint\",\"seq\":",
    ]
    .iter()
    .find_map(|p| head.strip_prefix(*p))?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let seq = std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()?;
    let prev = rest[digits..].strip_prefix(b",\"prev\":\"")?;
    (prev.len() > 64 && prev[..64].iter().all(u8::is_ascii_hexdigit) && prev[64] == b'"')
        .then_some(seq)
}

/// The first members of every line: enough to place it in the chain.
#[derive(Debug, Deserialize)]
pub(crate) struct LineHead {
    #[serde(rename = "type")]
    pub kind: String,
    pub seq: u64,
    pub prev: String,
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
    pub(crate) fn prev(&self) -> &str {
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
    let head: LineHead = serde_json::from_slice(line).map_err(|e| {
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

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case(b"{\"type\":\"audit\",\"seq\":12,\"prev\":\"0000000000000000000000000000000000000000000000000000000000000000\",", Some(12) ; "audit head")]
    #[test_case(b"{\"type\":\"checkpoint\",\"seq\":7,\"prev\":\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"", Some(7) ; "checkpoint head")]
    #[test_case(b"{\"type\":\"audit\",\"seq\":12,\"prev\":\"00\"", None ; "short prev")]
    #[test_case(b"{\"type\":\"other\",\"seq\":1,", None ; "unknown type")]
    #[test_case(b"\xff\xfe", None ; "binary")]
    #[test_case(b"{\"type\":\"audit\",\"seq\":99999999999999999999999,\"prev\":\"", None ; "seq overflow")]
    fn head_seq_table(head: &[u8], want: Option<u64>) {
        assert_eq!(head_seq(head), want);
    }
}
