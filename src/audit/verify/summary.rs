//! What `meshca audit verify` prints after a log passed: the chain's
//! figures, its runs and recoveries, the anchors it was checked against, and
//! the exceptions and gaps an auditor should know about.

use std::fmt;

use super::anchors::AnchorReport;
use super::VerifyReport;

/// A passed verification, as the command prints it (one fact per line).
#[derive(Debug, Clone, Copy)]
pub struct Summary<'a> {
    pub log: &'a VerifyReport,
    pub anchors: &'a AnchorReport,
    /// Anchors were given (`--anchor` files or `--anchors`): say how many
    /// stand in the log.
    pub anchored: bool,
    /// The anchors are the cluster's whole history (`--anchors`).
    pub history: bool,
    /// Checkpoint signatures were checked against at least one key.
    pub keys_given: bool,
}

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (r, a) = (self.log, self.anchors);
        writeln!(
            f,
            "OK: {} records, {} checkpoints ({} signature-verified), {} chain start(s), seq {}..{}",
            r.records,
            r.checkpoints,
            r.signed_checkpoints,
            r.chain_starts,
            r.first_seq.unwrap_or(0),
            r.last_seq.unwrap_or(0)
        )?;
        for run in &r.runs {
            writeln!(
                f,
                "run {} of replica {} from {} (seq {}): {} record(s) checkpointed, {} shed, last checkpoint {}",
                run.run,
                run.replica.escape_debug(),
                run.location,
                run.first_seq,
                run.records,
                run.shed,
                run.last_reason
            )?;
        }
        for note in &r.recoveries {
            writeln!(f, "{note}")?;
        }
        for (l, n) in &r.orphaned {
            writeln!(f, "note: the run starting at {l} continues from its anchored checkpoint after a crash; the {n} record(s) the crashed run wrote after that checkpoint stay in the log, covered by no checkpoint")?;
        }
        for l in &r.new_chains {
            writeln!(
                f,
                "note: a new chain starts at {l} (accepted by --allow-new-chain)"
            )?;
        }
        if let Some((l, seq)) = &r.partial_start {
            writeln!(f, "note: the log begins at {l}, continuing from seq {seq} of an earlier run (accepted by --partial)")?;
        }
        if self.anchored {
            let who = a.replica.as_deref().unwrap_or("-").escape_debug();
            write!(
                f,
                "anchors: replica {who}: {} anchor(s), {} in the log",
                a.anchors, a.matched
            )?;
            if self.history {
                write!(f, ", {} run(s) in the cluster's history", a.history_runs)?;
            }
            if a.before_log > 0 {
                write!(
                    f,
                    ", {} before the log's first line (accepted by --partial)",
                    a.before_log
                )?;
            }
            writeln!(f)?;
            if let Some(n) = &a.newest {
                writeln!(
                    f,
                    "anchor {}: replica {}'s newest anchored checkpoint, seq {}, matches {}",
                    n.source,
                    n.replica.escape_debug(),
                    n.seq,
                    n.location
                )?;
            }
        }
        for n in &a.notes {
            writeln!(f, "note: {n}")?;
        }
        if a.other_replicas > 0 {
            writeln!(
                f,
                "note: {} anchor(s) belong to other replicas and were skipped",
                a.other_replicas
            )?;
        }
        if let Some(first) = a.unanchored_after.first() {
            writeln!(
                f,
                "warning: {} start or shutdown checkpoint(s) after the newest anchor, from {first}, have no anchor: an anchor write failed for good (see meshca_audit_anchor_writes_total), or the anchor was removed",
                a.unanchored_after.len()
            )?;
        }
        if r.reduced_records > 0 {
            writeln!(f, "note: {} record(s) were written in reduced form (over the audit line cap; each names the full line's size and sha256)", r.reduced_records)?;
        }
        if !self.keys_given {
            writeln!(
                f,
                "warning: no --key given: checkpoint signatures were not checked"
            )?;
        }
        if r.unsigned_tail > 0 {
            writeln!(
                f,
                "warning: {} record(s) after the last checkpoint are not covered by a checkpoint",
                r.unsigned_tail
            )?;
        }
        Ok(())
    }
}
