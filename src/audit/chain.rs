//! The hash-chained audit sink. Each line carries `seq` and `prev` (the
//! SHA-256 of the previous line's bytes); checkpoint lines, signed with an
//! operator-configured key, commit to the chain head so that removing,
//! editing or reordering records is detectable by `meshca audit verify`.
//! The line format is [`super::format`], the keys [`super::keys`], and what
//! the sink finds at the end of an existing file [`tail`].

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use base64::Engine;
use time::OffsetDateTime;

use super::format::{fit_line, line_hash, Checkpoint, PreviousHead, Recovery, GENESIS};
use super::keys::{CheckpointKey, VerifyKey};
use super::{AuditError, AuditRecord, AuditSink};
use tail::{recover, Damage};

mod retain;
mod tail;

pub use retain::log_files;

/// Default cap on one audit line (`MESHCA_AUDIT_MAX_LINE_BYTES`).
pub const DEFAULT_MAX_LINE_BYTES: u64 = 16 * 1024;
/// Smallest line cap: a reduced record must always fit.
pub const MIN_MAX_LINE_BYTES: u64 = 4096;
/// Largest line cap.
pub const MAX_MAX_LINE_BYTES: u64 = 1024 * 1024;
/// Records between periodic checkpoints (`MESHCA_AUDIT_CHECKPOINT_EVERY`).
pub const DEFAULT_CHECKPOINT_EVERY: u64 = 1000;

/// Who writes a log: the replica (stable across restarts) and this run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunInfo {
    pub replica: String,
    pub run: String,
}

impl RunInfo {
    /// A new run of `replica` with a random id.
    pub fn new(replica: impl Into<String>) -> Self {
        let mut id = [0u8; 8];
        let _ = aws_lc_rs::rand::fill(&mut id);
        Self {
            replica: replica.into(),
            run: hex::encode(id),
        }
    }

    /// The replica named by `POD_NAME` (the chart sets it) or `HOSTNAME`.
    pub fn from_env() -> Self {
        let replica = ["POD_NAME", "HOSTNAME"]
            .iter()
            .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
            .unwrap_or_else(|| "meshca".into());
        Self::new(replica)
    }
}

/// Where a sink writes.
pub enum Destination {
    /// Standard output: only audit lines go there (logs go to stderr).
    Stdout,
    /// A file rotated by size: `path`, `path.1`, ... `path.<max_files-1>`,
    /// and older files past the count while they hold an issuance record
    /// younger than `retain_issued` (zero: by count alone).
    File {
        path: PathBuf,
        max_bytes: u64,
        max_files: u32,
        retain_issued: std::time::Duration,
    },
    /// In memory (tests; read back with [`ChainedSink::buffer_contents`]).
    Buffer,
    /// Any writer (tests: a disk that fills up part-way through a line).
    Writer(Box<dyn Write + Send>),
}

impl Destination {
    /// A file rotated by size, deleted by count (see [`Destination::File`]).
    pub fn file(path: impl AsRef<Path>, max_bytes: u64, max_files: u32) -> Self {
        Self::File {
            path: path.as_ref().to_path_buf(),
            max_bytes,
            max_files,
            retain_issued: std::time::Duration::ZERO,
        }
    }

    /// A file destination whose rotation keeps files holding issuance
    /// records younger than `retain` (no effect on other destinations).
    pub fn retaining_issued(mut self, retain: std::time::Duration) -> Self {
        if let Self::File { retain_issued, .. } = &mut self {
            *retain_issued = retain;
        }
        self
    }
}

/// How a [`ChainedSink`] is opened.
pub struct SinkOptions {
    pub to: Destination,
    /// Signs checkpoints; without it they are unsigned (the hash chain still
    /// detects edits).
    pub key: Option<CheckpointKey>,
    /// A periodic checkpoint after this many records (at least 1).
    pub checkpoint_every: u64,
    /// Cap on one line, clamped to
    /// [`MIN_MAX_LINE_BYTES`]..=[`MAX_MAX_LINE_BYTES`].
    pub max_line_bytes: u64,
    /// Who writes the log.
    pub run: RunInfo,
    /// Seq and line hash of the previous run's last line, as anchored
    /// outside the pod, for a destination that cannot be read back (stdout).
    /// A file continues from its own last good line and ignores it.
    pub head: Option<(u64, String)>,
}

impl SinkOptions {
    /// Writing to `to` with the defaults: unsigned checkpoints every
    /// [`DEFAULT_CHECKPOINT_EVERY`] records, the default line cap, the run
    /// named by the environment ([`RunInfo::from_env`]) and a new chain.
    pub fn new(to: Destination) -> Self {
        Self {
            to,
            key: None,
            checkpoint_every: DEFAULT_CHECKPOINT_EVERY,
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            run: RunInfo::from_env(),
            head: None,
        }
    }
}

/// Where lines are written, once open.
enum Output {
    /// Standard output.
    Stdout,
    /// The current file of a rotated log.
    File {
        path: PathBuf,
        file: File,
        size: u64,
        max_bytes: u64,
        max_files: u32,
        retain_issued: std::time::Duration,
        /// The newest issuance record of each file, as far as known
        /// (index 0: the current file; see [`retain::Issued`]).
        issued: Vec<retain::Issued>,
    },
    Buffer(Vec<u8>),
    Writer(Box<dyn Write + Send>),
}

impl std::fmt::Debug for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Stdout => f.write_str("Stdout"),
            Self::File { path, size, .. } => write!(f, "File({}, {size} bytes)", path.display()),
            Self::Buffer(b) => write!(f, "Buffer({} bytes)", b.len()),
            Self::Writer(_) => f.write_str("Writer"),
        }
    }
}

#[derive(Debug)]
struct State {
    out: Output,
    seq: u64,
    prev: String,
    records: u64,
    since_checkpoint: u64,
    damage: Option<Damage>,
    /// Set until the run's start checkpoint is written.
    previous: Option<PreviousHead>,
    last_checkpoint: Option<String>,
    /// Lines held back by [`ChainedSink::begin_stage`], written in one go.
    stage: Option<Stage>,
    /// The stage buffer's allocation, kept between batches.
    stage_spare: Vec<u8>,
}

/// Lines rendered and chained but not yet handed to the output: a writer
/// batch costs one write(2) instead of one per record (a write per record
/// was most of the writer's cost under load). The chain
/// head advances as each line is staged; `from` is the head before the
/// staged bytes, to go back to when their write fails.
#[derive(Debug)]
struct Stage {
    buf: Vec<u8>,
    from: Head,
    /// Set once a write of this stage failed: nothing more is staged, so the
    /// log never holds a record after lost ones of the same batch.
    failed: Option<String>,
}

/// The chain head and counters that a failed staged write, or a rollback
/// after a failed fsync, goes back to.
#[derive(Debug, Clone)]
struct Head {
    seq: u64,
    prev: String,
    records: u64,
    since_checkpoint: u64,
    last_checkpoint: Option<String>,
}

impl State {
    fn head(&self) -> Head {
        Head {
            seq: self.seq,
            prev: self.prev.clone(),
            records: self.records,
            since_checkpoint: self.since_checkpoint,
            last_checkpoint: self.last_checkpoint.clone(),
        }
    }

    fn restore(&mut self, h: Head) {
        self.seq = h.seq;
        self.prev = h.prev;
        self.records = h.records;
        self.since_checkpoint = h.since_checkpoint;
        self.last_checkpoint = h.last_checkpoint;
    }

    fn staged_len(&self) -> usize {
        self.stage.as_ref().map_or(0, |s| s.buf.len())
    }
}

/// The chain position before a batch of writes, to undo them when the
/// fsync that should cover them fails (see [`ChainedSink::rollback`]).
#[derive(Debug, Clone)]
pub struct Mark {
    head: Head,
    size: Option<u64>,
    rotations: u64,
}

/// The hash-chaining sink.
#[derive(Debug)]
pub struct ChainedSink {
    state: Mutex<State>,
    key: Option<CheckpointKey>,
    checkpoint_every: u64,
    max_line_bytes: u64,
    run: RunInfo,
    /// Requests shed by the writer in front of this sink (see `writer`).
    shed: Arc<AtomicU64>,
    /// Files rotated by this sink (a rollback cannot cross one).
    rotations: AtomicU64,
    /// Checkpoints written by this sink (anchors follow the newest).
    checkpoints: AtomicU64,
    /// Files kept past the count for their issuance records
    /// (`meshca_audit_files_retained`).
    retained: prometheus_client::metrics::gauge::Gauge,
}

impl ChainedSink {
    /// Opens a sink as `opts` say and writes its `start` checkpoint (after a
    /// `recovery` checkpoint when the file it continues ends in damage).
    ///
    /// A file is continued from its last good line. Damage at the end (a torn
    /// line, garbage, an over-cap line) never stops startup: it is left in
    /// place and described by a signed `recovery` checkpoint; if no good line
    /// is found the file is rotated away and a new segment names its old
    /// head. Any other destination continues from `opts.head`, or starts a
    /// new chain without one.
    pub fn open(opts: SinkOptions) -> Result<Self, AuditError> {
        let max_line_bytes = opts
            .max_line_bytes
            .clamp(MIN_MAX_LINE_BYTES, MAX_MAX_LINE_BYTES);
        // Without a file to read, the chain continues from the head given.
        let linked = |out| {
            let (seq, prev) = opts
                .head
                .map_or((0, GENESIS.to_string()), |(s, h)| (s + 1, h));
            (out, seq, prev, None, "anchor")
        };
        let (out, seq, prev, damage, previous_from) = match opts.to {
            Destination::File {
                path,
                max_bytes,
                max_files,
                retain_issued,
            } => {
                let (out, seq, prev, damage) =
                    open_file(path, max_bytes, max_files, retain_issued, max_line_bytes)?;
                (out, seq, prev, damage, "file")
            }
            Destination::Stdout => linked(Output::Stdout),
            Destination::Buffer => linked(Output::Buffer(Vec::new())),
            Destination::Writer(w) => linked(Output::Writer(w)),
        };
        let previous = (prev != GENESIS && seq > 0).then(|| PreviousHead {
            seq: seq - 1,
            hash: prev.clone(),
            from: previous_from.into(),
        });
        let sink = Self {
            state: Mutex::new(State {
                out,
                seq,
                prev,
                records: 0,
                since_checkpoint: 0,
                damage,
                previous,
                last_checkpoint: None,
                stage: None,
                stage_spare: Vec::new(),
            }),
            key: opts.key,
            checkpoint_every: opts.checkpoint_every.max(1),
            max_line_bytes,
            run: opts.run,
            shed: Arc::new(AtomicU64::new(0)),
            rotations: AtomicU64::new(0),
            checkpoints: AtomicU64::new(0),
            retained: Default::default(),
        };
        // Every start is marked, so restarts are visible in the log (a
        // pending recovery is written first).
        sink.checkpoint("start")?;
        Ok(sink)
    }

    /// Writes a checkpoint now.
    pub fn checkpoint(&self, reason: &str) -> Result<(), AuditError> {
        let mut st = self
            .state
            .lock()
            .map_err(|_| AuditError("audit state poisoned".into()))?;
        self.write_checkpoint(&mut st, reason)
    }

    /// Writes a checkpoint if records were written since the last one.
    pub fn checkpoint_if_pending(&self, reason: &str) -> Result<(), AuditError> {
        let mut st = self
            .state
            .lock()
            .map_err(|_| AuditError("audit state poisoned".into()))?;
        if st.since_checkpoint > 0 {
            self.write_checkpoint(&mut st, reason)?;
        }
        Ok(())
    }

    /// The bytes written so far (Buffer output only).
    pub fn buffer_contents(&self) -> String {
        match self.state.lock().as_deref() {
            Ok(State {
                out: Output::Buffer(b),
                ..
            }) => String::from_utf8_lossy(b).into_owned(),
            _ => String::new(),
        }
    }

    fn write_checkpoint(&self, st: &mut State, reason: &str) -> Result<(), AuditError> {
        self.settle(st)?;
        let line = self.checkpoint_line(st, reason, None)?;
        self.write_line(st, &line)?;
        st.since_checkpoint = 0;
        st.last_checkpoint = Some(line);
        self.checkpoints.fetch_add(1, Ordering::Relaxed);
        if reason == "start" {
            st.previous = None;
        }
        Ok(())
    }

    /// The public key of the checkpoint key, when checkpoints are signed.
    pub fn verify_key(&self) -> Option<VerifyKey> {
        self.key.as_ref().map(CheckpointKey::verify_key)
    }

    /// Reports in `gauge` how many files are kept past the count for their
    /// issuance records (from the files on disk now, then at each rotation).
    pub fn report_retained_in(mut self, gauge: prometheus_client::metrics::gauge::Gauge) -> Self {
        if let Ok(st) = self.state.lock() {
            if let Output::File {
                path, max_files, ..
            } = &st.out
            {
                let past = retain::rotated_numbers(path)
                    .map(|v| v.iter().filter(|i| **i >= *max_files).count())
                    .unwrap_or(0);
                gauge.set(i64::try_from(past).unwrap_or(i64::MAX));
            }
        }
        self.retained = gauge;
        self
    }

    /// The run this sink writes.
    pub fn run(&self) -> &RunInfo {
        &self.run
    }

    /// The counter of shed requests that checkpoints report.
    pub fn shed_counter(&self) -> Arc<AtomicU64> {
        self.shed.clone()
    }

    /// The chain head: seq and hash of the last line written.
    pub fn head(&self) -> Option<(u64, String)> {
        let st = self.state.lock().ok()?;
        (st.seq > 0).then(|| (st.seq - 1, st.prev.clone()))
    }

    /// How many checkpoints this sink has written.
    pub fn checkpoint_count(&self) -> u64 {
        self.checkpoints.load(Ordering::Relaxed)
    }

    /// The last checkpoint line written (for anchoring).
    pub fn last_checkpoint(&self) -> Option<String> {
        self.state.lock().ok()?.last_checkpoint.clone()
    }

    /// Makes what was written durable: fsync for a file (data only: the
    /// size change is part of it), a flush otherwise.
    pub fn sync(&self) -> Result<(), AuditError> {
        let mut st = self
            .state
            .lock()
            .map_err(|_| AuditError("audit state poisoned".into()))?;
        flush_stage(&mut st)?;
        match &mut st.out {
            Output::File { file, path, .. } => file
                .sync_data()
                .map_err(|e| AuditError(format!("fsync {}: {e}", path.display()))),
            Output::Stdout => std::io::stdout()
                .flush()
                .map_err(|e| AuditError(format!("stdout: {e}"))),
            Output::Writer(w) => w.flush().map_err(|e| AuditError(e.to_string())),
            Output::Buffer(_) => Ok(()),
        }
    }

    /// The chain position now, to [`Self::rollback`] to.
    pub fn mark(&self) -> Option<Mark> {
        let st = self.state.lock().ok()?;
        Some(Mark {
            head: st.head(),
            // Staged lines count as written: a mark taken inside a stage is
            // the position after them (see `rollback`).
            size: match &st.out {
                Output::File { size, .. } => Some(*size + st.staged_len() as u64),
                _ => None,
            },
            rotations: self.rotations.load(Ordering::Relaxed),
        })
    }

    /// Undoes the lines written since `mark` after the fsync meant to cover
    /// them failed: the file is cut back to its size then, so the log never
    /// holds a record whose request was refused. Only a file can be cut;
    /// returns whether the lines are gone.
    pub fn rollback(&self, mark: &Mark) -> bool {
        let Ok(mut st) = self.state.lock() else {
            return false;
        };
        if self.rotations.load(Ordering::Relaxed) != mark.rotations {
            return false;
        }
        let (Output::File { file, size, .. }, Some(to)) = (&mut st.out, mark.size) else {
            return false;
        };
        // Past the end: the staged lines after the mark were never written
        // (their failed write already put the head back before them).
        if to > *size || file.set_len(to).is_err() {
            return false;
        }
        *size = to;
        st.restore(mark.head.clone());
        if let Some(stage) = &mut st.stage {
            stage.buf.clear();
            stage.from = mark.head.clone();
        }
        true
    }

    fn checkpoint_line(
        &self,
        st: &State,
        reason: &str,
        recovery: Option<Recovery>,
    ) -> Result<String, AuditError> {
        let time = OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .map_err(|e| AuditError(e.to_string()))?;
        let mut cp = Checkpoint {
            kind: "checkpoint".into(),
            seq: st.seq,
            prev: st.prev.clone(),
            time,
            reason: reason.into(),
            records: st.records,
            alg: "none".into(),
            key_id: None,
            sig: None,
            recovery,
            replica: Some(self.run.replica.clone()),
            run: Some(self.run.run.clone()),
            count: Some(st.since_checkpoint),
            previous: st.previous.clone(),
            shed: Some(self.shed.load(Ordering::Relaxed)),
        };
        if let Some(key) = &self.key {
            cp.alg = key.alg().into();
            cp.key_id = Some(key.verify_key().key_id());
            cp.sig =
                Some(base64::engine::general_purpose::STANDARD.encode(key.sign(&cp.message())?));
        }
        serde_json::to_string(&cp).map_err(|e| AuditError(e.to_string()))
    }

    /// Describes pending damage with a recovery checkpoint (after a newline
    /// if the damage ended mid-line), so a record is never glued onto a torn
    /// line. Called before a line is rendered: it moves the chain head.
    fn settle(&self, st: &mut State) -> Result<(), AuditError> {
        let Some(damage) = &st.damage else {
            return Ok(());
        };
        let open = damage.open;
        let cp = self.checkpoint_line(st, "recovery", Some(damage.recovery()))?;
        let mut buf = Vec::with_capacity(cp.len() + 2);
        if open {
            buf.push(b'\n');
        }
        buf.extend_from_slice(cp.as_bytes());
        buf.push(b'\n');
        let (stands, result) = append(st, &buf);
        if stands {
            st.damage = None;
            st.prev = line_hash(&cp);
            st.seq += 1;
            st.since_checkpoint = 0;
            st.last_checkpoint = Some(cp);
            self.checkpoints.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    /// Appends one line (rendered at the current head) and advances the chain.
    fn write_line(&self, st: &mut State, line: &str) -> Result<(), AuditError> {
        if st.damage.is_some() {
            return Err(AuditError(
                "audit damage not yet recorded; line not written".into(),
            ));
        }
        if let Some(stage) = &mut st.stage {
            if let Some(e) = &stage.failed {
                return Err(AuditError(e.clone()));
            }
            stage.buf.extend_from_slice(line.as_bytes());
            stage.buf.push(b'\n');
            st.prev = line_hash(line);
            st.seq += 1;
            return Ok(());
        }
        let mut buf = Vec::with_capacity(line.len() + 1);
        buf.extend_from_slice(line.as_bytes());
        buf.push(b'\n');
        let (stands, result) = append(st, &buf);
        if stands {
            st.prev = line_hash(line);
            st.seq += 1;
        }
        result
    }

    /// From now on lines are chained and kept in memory until
    /// [`Self::end_stage`] (or a sync, a rotation or a checkpoint handed to an
    /// anchor) writes them with one write(2). The audit writer stages each
    /// batch; a record is acknowledged only after the stage is written.
    pub fn begin_stage(&self) {
        if let Ok(mut st) = self.state.lock() {
            if st.stage.is_none() {
                let buf = std::mem::take(&mut st.stage_spare);
                let from = st.head();
                st.stage = Some(Stage {
                    buf,
                    from,
                    failed: None,
                });
            }
        }
    }

    /// Writes what is staged now (the stage stays open).
    pub fn flush_staged(&self) -> Result<(), AuditError> {
        let mut st = self
            .state
            .lock()
            .map_err(|_| AuditError("audit state poisoned".into()))?;
        flush_stage(&mut st)
    }

    /// Writes what is staged and stops staging. An error means every line
    /// staged since the last successful write is not in the log (the chain
    /// head is back before them) and their requests must be refused.
    pub fn end_stage(&self) -> Result<(), AuditError> {
        let mut st = self
            .state
            .lock()
            .map_err(|_| AuditError("audit state poisoned".into()))?;
        let r = flush_stage(&mut st);
        if let Some(mut stage) = st.stage.take() {
            stage.buf.clear();
            st.stage_spare = stage.buf;
        }
        r
    }
}

/// Writes the staged lines with one `append`. When they do not all stand,
/// the head goes back to before them and the stage refuses further lines.
fn flush_stage(st: &mut State) -> Result<(), AuditError> {
    let buf = match &mut st.stage {
        None => return Ok(()),
        Some(Stage {
            failed: Some(e), ..
        }) => return Err(AuditError(e.clone())),
        Some(stage) if stage.buf.is_empty() => return Ok(()),
        Some(stage) => std::mem::take(&mut stage.buf),
    };
    let (stands, result) = append(st, &buf);
    let written_head = stands.then(|| st.head());
    if let Some(stage) = &mut st.stage {
        let mut buf = buf;
        buf.clear();
        stage.buf = buf;
        match written_head {
            Some(h) => stage.from = h,
            None => {
                let from = stage.from.clone();
                stage.failed = Some(
                    result
                        .as_ref()
                        .err()
                        .map_or_else(|| "audit write failed".into(), |e| e.0.clone()),
                );
                st.restore(from);
            }
        }
    }
    result
}

/// Writes `buf` whole or records what a failed write left behind: a file is
/// truncated back to its last good line; otherwise the partial bytes become
/// damage that the next write terminates and describes. Returns whether the
/// line stands (every byte was accepted, so the chain advances) and the
/// error, if any (issuance fails closed on it either way).
fn append(st: &mut State, buf: &[u8]) -> (bool, Result<(), AuditError>) {
    let (written, result) = match &mut st.out {
        Output::Stdout => {
            let mut out = std::io::stdout().lock();
            let (n, r) = write_counted(&mut out, buf);
            (n, r.and_then(|_| out.flush()))
        }
        Output::File { file, .. } => write_counted(file, buf),
        Output::Buffer(b) => {
            b.extend_from_slice(buf);
            (buf.len(), Ok(()))
        }
        Output::Writer(w) => {
            let (n, r) = write_counted(w, buf);
            (n, r.and_then(|_| w.flush()))
        }
    };
    let mut left = &buf[..written];
    if let Output::File { file, size, .. } = &mut st.out {
        if written < buf.len() && file.set_len(*size).is_ok() {
            left = &[];
        }
        *size += left.len() as u64;
    }
    let Err(e) = result else {
        return (true, Ok(()));
    };
    let where_ = match &st.out {
        Output::File { path, .. } => path.display().to_string(),
        Output::Stdout => "stdout".into(),
        _ => "audit output".into(),
    };
    if written == buf.len() {
        // Every byte was accepted (a flush failed): the line stands.
        return (true, Err(AuditError(format!("{where_}: {e}"))));
    }
    let damage = st.damage.get_or_insert_with(|| Damage::new("write_error"));
    damage.add(left);
    if damage.open && damage.found == "write_error" {
        damage.found = "torn_line";
    }
    (false, Err(AuditError(format!("{where_}: {e}"))))
}

/// `write_all` that reports how many bytes went out before an error.
fn write_counted(w: &mut impl Write, buf: &[u8]) -> (usize, std::io::Result<()>) {
    let mut n = 0;
    while n < buf.len() {
        match w.write(&buf[n..]) {
            Ok(0) => {
                return (
                    n,
                    Err(std::io::Error::new(
                        std::io::ErrorKind::WriteZero,
                        "write returned 0",
                    )),
                )
            }
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return (n, Err(e)),
        }
    }
    (n, Ok(()))
}

/// Opens the log file for appending, continuing from its tail.
fn open_file(
    path: PathBuf,
    max_bytes: u64,
    max_files: u32,
    retain_issued: std::time::Duration,
    max_line: u64,
) -> Result<(Output, u64, String, Option<Damage>), AuditError> {
    let io = |e: std::io::Error| AuditError(format!("{}: {e}", path.display()));
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let (seq, prev, damage) = recover(&path, max_line, max_files, retain_issued).map_err(io)?;
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    let out = Output::File {
        path,
        file,
        size,
        max_bytes: max_bytes.max(4096),
        max_files: max_files.max(1),
        retain_issued,
        // What an existing file holds is read if it is ever to be deleted.
        issued: vec![if size == 0 { Some(None) } else { None }],
    };
    Ok((out, seq, prev, damage))
}

fn needs_rotation(st: &State, line_len: usize) -> bool {
    // Staged lines go to the current file first.
    let Output::File {
        size, max_bytes, ..
    } = &st.out
    else {
        return false;
    };
    let size = *size + st.staged_len() as u64;
    size > 0 && size + line_len as u64 + 1 > *max_bytes
}

impl ChainedSink {
    /// Starts a new file whose first line is a `rotation` checkpoint carrying
    /// the chain on (signed when a key is configured), so each file can be
    /// verified on its own from that anchor.
    fn rotate(&self, st: &mut State) -> Result<(), AuditError> {
        // Staged lines belong to the file being rotated away.
        flush_stage(st)?;
        let Output::File {
            path,
            max_files,
            file,
            retain_issued,
            issued,
            ..
        } = &mut st.out
        else {
            return Ok(());
        };
        let (path, max_files, retain) = (path.clone(), *max_files, *retain_issued);
        let io = |e: std::io::Error| AuditError(format!("rotating {}: {e}", path.display()));
        if let Some(d) = st.damage.as_mut().filter(|d| d.open) {
            // Terminate a torn line in the file it belongs to.
            file.write_all(b"\n").map_err(io)?;
            d.add(b"\n");
        }
        file.sync_data().map_err(io)?;
        let rotated =
            retain::rotate_files(&path, max_files, retain, issued, OffsetDateTime::now_utc())
                .map_err(io)?;
        self.rotations.fetch_add(1, Ordering::Relaxed);
        // File i is now i + 1; a fresh current file holds nothing.
        let mut now_known = Vec::with_capacity(rotated.files as usize + 1);
        now_known.push(Some(None));
        now_known.extend((0..rotated.files as usize).map(|i| issued.get(i).copied().flatten()));
        *issued = now_known;
        let was = self.retained.set(i64::from(rotated.retained));
        if rotated.retained > 0 && was < i64::from(rotated.retained) {
            tracing::warn!(
                retained = rotated.retained,
                files = rotated.files + 1,
                max_files,
                "audit files kept past --audit-max-files: they hold issuance records younger than --audit-retain-issued"
            );
        }
        let new = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io)?;
        if let Output::File { file, size, .. } = &mut st.out {
            *file = new;
            *size = 0;
        }
        self.write_checkpoint(st, "rotation")
    }
}

impl AuditSink for ChainedSink {
    fn emit(&self, record: &AuditRecord) -> Result<(), AuditError> {
        let mut st = self
            .state
            .lock()
            .map_err(|_| AuditError("audit state poisoned".into()))?;
        self.settle(&mut st)?;
        // A due checkpoint goes first: if it cannot be written the record is
        // not written either, so the log never says `allow` for a request
        // that was refused.
        if st.since_checkpoint >= self.checkpoint_every {
            self.write_checkpoint(&mut st, "periodic")?;
        }
        let mut line = fit_line(st.seq, &st.prev, record, self.max_line_bytes)?;
        if needs_rotation(&st, line.len()) {
            self.rotate(&mut st)?;
            line = fit_line(st.seq, &st.prev, record, self.max_line_bytes)?;
        }
        self.write_line(&mut st, &line)?;
        st.records += 1;
        st.since_checkpoint += 1;
        if record.decision == super::Decision::Allow {
            if let Output::File { issued, .. } = &mut st.out {
                // Only ever moves forward: a rolled-back line may keep its
                // file a little longer, never shorter.
                if let Some(Some(newest)) = issued.first_mut() {
                    *newest = Some(newest.map_or(record.time, |t| t.max(record.time)));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::format::parse_line;
    use crate::audit::verify::{read_lines, verify_lines};
    use crate::audit::Decision;
    use std::sync::Arc;
    use test_case::test_case;

    pub(super) fn record(i: u64) -> AuditRecord {
        AuditRecord {
            caller_identity: Some("spiffe://cluster.local/ns/a/sa/é".into()),
            latency_ms: 1.0,
            ..AuditRecord::new(
                OffsetDateTime::now_utc(),
                format!("req-{i}"),
                Decision::Allow,
                "issued".into(),
            )
        }
    }

    /// A disk that accepts `budget` more bytes, then fails with ENOSPC.
    #[derive(Clone, Default)]
    struct Disk {
        data: Arc<Mutex<Vec<u8>>>,
        budget: Arc<Mutex<Option<usize>>>,
        fail_flush: Arc<Mutex<bool>>,
    }

    impl Write for Disk {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let mut budget = self.budget.lock().unwrap();
            let n = match *budget {
                None => buf.len(),
                Some(0) => return Err(std::io::Error::from_raw_os_error(28)),
                Some(b) => b.min(buf.len()),
            };
            if let Some(b) = budget.as_mut() {
                *b -= n;
            }
            self.data.lock().unwrap().extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            if *self.fail_flush.lock().unwrap() {
                return Err(std::io::Error::from_raw_os_error(5));
            }
            Ok(())
        }
    }

    #[test]
    fn a_failed_flush_after_a_whole_line_keeps_the_chain() {
        let disk = Disk::default();
        let sink = ChainedSink::open(SinkOptions::new(Destination::Writer(Box::new(
            disk.clone(),
        ))))
        .unwrap();
        *disk.fail_flush.lock().unwrap() = true;
        assert!(sink.emit(&record(1)).is_err(), "fail closed");
        *disk.fail_flush.lock().unwrap() = false;
        sink.emit(&record(2)).unwrap();
        let data = disk.data.lock().unwrap().clone();
        let report = verify_lines(&lines_of(&data), None).unwrap();
        assert_eq!(
            report.records, 2,
            "the flushed-late line stands in the chain"
        );
        assert!(report.recoveries.is_empty());
    }

    fn lines_of(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
        let mut v: Vec<(String, Vec<u8>)> = bytes
            .split(|b| *b == b'\n')
            .enumerate()
            .map(|(i, l)| (format!("mem:{}", i + 1), l.to_vec()))
            .collect();
        if bytes.ends_with(b"\n") {
            v.pop();
        }
        v
    }

    #[test_case(Some(40), "torn_line", 1 ; "disk fills mid-line")]
    #[test_case(Some(0), "write_error", 0 ; "disk full before the first byte")]
    fn a_failed_write_never_glues_the_next_record(budget: Option<usize>, found: &str, lines: u64) {
        let disk = Disk::default();
        let sink = ChainedSink::open(SinkOptions::new(Destination::Writer(Box::new(
            disk.clone(),
        ))))
        .unwrap();
        sink.emit(&record(1)).unwrap();
        *disk.budget.lock().unwrap() = budget;
        assert!(sink.emit(&record(2)).is_err(), "fail closed");
        *disk.budget.lock().unwrap() = None;
        sink.emit(&record(3)).unwrap();
        sink.checkpoint("shutdown").unwrap();
        let data = disk.data.lock().unwrap().clone();
        let lines_read = lines_of(&data);
        // Every line is either a whole chain line or the one torn fragment.
        let broken = lines_read
            .iter()
            .filter(|(_, l)| parse_line(l).is_err())
            .count() as u64;
        assert_eq!(broken, lines);
        let report = verify_lines(&lines_read, None).unwrap();
        assert_eq!(report.records, 2);
        assert_eq!(report.recoveries.len(), 1);
        assert_eq!(report.recoveries[0].recovery.found, found);
        assert_eq!(report.recoveries[0].recovery.damaged_lines, lines);
        assert!(report.recoveries[0].recovery.continued);
    }

    #[test]
    fn an_over_cap_record_is_written_reduced_and_says_so() {
        let sink = ChainedSink::open(SinkOptions {
            max_line_bytes: 4096,
            ..SinkOptions::new(Destination::Buffer)
        })
        .unwrap();
        let mut r = record(1);
        r.detail = Some("x".repeat(100_000));
        r.requested_identity = Some("y".repeat(100_000));
        sink.emit(&r).unwrap();
        let text = sink.buffer_contents();
        let lines: Vec<(String, String)> = text
            .lines()
            .enumerate()
            .map(|(i, l)| (format!("mem:{i}"), l.to_string()))
            .collect();
        assert!(lines.iter().all(|(_, l)| l.len() < 4096));
        let rep = verify_lines(&lines, None).unwrap();
        assert_eq!(rep.reduced_records, 1);
        let v: serde_json::Value = serde_json::from_str(&lines[1].1).unwrap();
        assert_eq!(v["reduced"]["max_line_bytes"], 4096);
        assert!(v["reduced"]["line_bytes"].as_u64().unwrap() > 200_000);
        assert_eq!(v["reason"], "issued");
    }

    #[test]
    fn a_checkpoint_that_cannot_be_written_keeps_the_record_out_too() {
        // Record-then-Internal: the due checkpoint goes first, so when it
        // fails the record saying `allow` is never written.
        let disk = Disk::default();
        let sink = ChainedSink::open(SinkOptions {
            checkpoint_every: 1,
            ..SinkOptions::new(Destination::Writer(Box::new(disk.clone())))
        })
        .unwrap();
        sink.emit(&record(1)).unwrap();
        *disk.budget.lock().unwrap() = Some(0);
        assert!(sink.emit(&record(2)).is_err());
        let data = String::from_utf8(disk.data.lock().unwrap().clone()).unwrap();
        assert!(data.contains("\"req-1\""));
        assert!(!data.contains("\"req-2\""), "{data}");
    }

    #[test]
    fn a_rollback_cuts_the_lines_an_fsync_failed_to_cover() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let sink = ChainedSink::open(SinkOptions {
            checkpoint_every: 2,
            ..SinkOptions::new(Destination::file(&path, 1 << 30, 3))
        })
        .unwrap();
        sink.emit(&record(1)).unwrap();
        let before = std::fs::read(&path).unwrap();
        let mark = sink.mark().unwrap();
        sink.emit(&record(2)).unwrap();
        sink.emit(&record(3)).unwrap(); // a periodic checkpoint goes first
        assert!(sink.rollback(&mark));
        assert_eq!(std::fs::read(&path).unwrap(), before);
        sink.emit(&record(4)).unwrap();
        sink.checkpoint("shutdown").unwrap();
        let rep = verify_lines(&read_lines(&[&path]).unwrap(), None).unwrap();
        assert_eq!(rep.records, 2);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("\"req-2\"") && !text.contains("\"req-3\""));
    }

    /// Counts the write calls that reach the output.
    #[derive(Clone, Default)]
    struct Counted(Disk, Arc<Mutex<usize>>);

    impl Write for Counted {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            *self.1.lock().unwrap() += 1;
            self.0.write(buf)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.0.flush()
        }
    }

    #[test]
    fn a_stage_writes_its_lines_with_one_write_and_they_verify() {
        let out = Counted::default();
        let sink = ChainedSink::open(SinkOptions {
            checkpoint_every: 4,
            ..SinkOptions::new(Destination::Writer(Box::new(out.clone())))
        })
        .unwrap();
        let before = *out.1.lock().unwrap();
        sink.begin_stage();
        for i in 0..10 {
            sink.emit(&record(i)).unwrap(); // two periodic checkpoints among them
        }
        assert_eq!(
            *out.1.lock().unwrap(),
            before,
            "nothing written while staged"
        );
        sink.end_stage().unwrap();
        assert_eq!(
            *out.1.lock().unwrap(),
            before + 1,
            "one write for the stage"
        );
        sink.emit(&record(10)).unwrap();
        assert_eq!(*out.1.lock().unwrap(), before + 2, "unstaged: one per line");
        sink.checkpoint("shutdown").unwrap();
        let data = out.0.data.lock().unwrap().clone();
        let rep = verify_lines(&lines_of(&data), None).unwrap();
        assert_eq!(rep.records, 11);
        assert!(rep.recoveries.is_empty());
    }

    // A stage whose write fails: nothing of it stands in the chain, nothing
    // more is staged after it, and the next batch chains on from the last
    // line that is really in the output.
    #[test_case(Some(300), "torn_line" ; "disk fills inside the staged bytes")]
    #[test_case(Some(0), "write_error" ; "disk full before the first staged byte")]
    fn a_failed_stage_write_takes_none_of_its_lines(budget: Option<usize>, found: &str) {
        let disk = Disk::default();
        let sink = ChainedSink::open(SinkOptions::new(Destination::Writer(Box::new(
            disk.clone(),
        ))))
        .unwrap();
        sink.emit(&record(1)).unwrap();
        sink.begin_stage();
        sink.emit(&record(2)).unwrap();
        sink.emit(&record(3)).unwrap();
        *disk.budget.lock().unwrap() = budget;
        assert!(sink.flush_staged().is_err(), "fail closed");
        *disk.budget.lock().unwrap() = None;
        assert!(
            sink.emit(&record(4)).is_err(),
            "a failed stage takes no more lines"
        );
        assert!(sink.end_stage().is_err());
        sink.emit(&record(5)).unwrap();
        sink.checkpoint("shutdown").unwrap();
        let data = disk.data.lock().unwrap().clone();
        let rep = verify_lines(&lines_of(&data), None).unwrap();
        assert_eq!(rep.records, 2, "req-1 and req-5 only");
        assert_eq!(rep.recoveries.len(), 1);
        assert_eq!(rep.recoveries[0].recovery.found, found);
        let text = String::from_utf8_lossy(&data);
        assert!(!text.contains("\"req-4\""));
    }

    #[test]
    fn a_file_stage_that_fails_is_cut_back_and_rotation_writes_the_stage_first() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        // Small files: the stage crosses several rotations.
        let sink = ChainedSink::open(SinkOptions::new(Destination::file(&path, 8192, 20))).unwrap();
        sink.begin_stage();
        for i in 0..60 {
            sink.emit(&record(i)).unwrap();
        }
        sink.end_stage().unwrap();
        let mark = sink.mark().unwrap();
        sink.begin_stage();
        sink.emit(&record(60)).unwrap();
        // An fsync that fails after the staged write: the batch is cut.
        sink.sync().unwrap();
        assert!(sink.rollback(&mark));
        sink.end_stage().unwrap();
        sink.emit(&record(61)).unwrap();
        sink.checkpoint("shutdown").unwrap();
        let mut files: Vec<PathBuf> = (1..20)
            .rev()
            .map(|i| PathBuf::from(format!("{}.{i}", path.display())))
            .filter(|p| p.exists())
            .collect();
        assert!(files.len() >= 3, "rotated {} times", files.len());
        files.push(path.clone());
        let refs: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
        let rep = verify_lines(&read_lines(&refs).unwrap(), None).unwrap();
        assert_eq!(rep.records, 61, "req-0..59 and req-61");
        let all: String = files
            .iter()
            .map(|f| std::fs::read_to_string(f).unwrap())
            .collect();
        assert!(!all.contains("\"req-60\""));
    }

    #[test]
    fn a_sec1_p256_key_as_helm_generates_it_signs_checkpoints() {
        // `genPrivateKey "ecdsa"` in the chart writes this form (a throwaway
        // test key made with `openssl ecparam -genkey -name prime256v1`).
        let pem = "-----BEGIN EC PRIVATE KEY-----\n\
MHcCAQEEID67S8+86QY+fYpSqahCgnBuqpfPBg+2Hqs+lvN+zWGPoAoGCCqGSM49\n\
AwEHoUQDQgAEMYWRM98BAPzMWtA247At2bCycVYLi3wbNdbTbnxrIwOH/u7Y/izh\n\
5LKwhfe1qRrlikH36TR04t87iAaHL3wrgw==\n\
-----END EC PRIVATE KEY-----\n";
        let key = CheckpointKey::from_pem(pem.as_bytes()).unwrap();
        let vk = key.verify_key();
        let sink = ChainedSink::open(SinkOptions {
            key: Some(key),
            checkpoint_every: 1,
            ..SinkOptions::new(Destination::Buffer)
        })
        .unwrap();
        sink.emit(&record(1)).unwrap();
        let text = sink.buffer_contents();
        let lines: Vec<(String, String)> = text
            .lines()
            .enumerate()
            .map(|(i, l)| (format!("mem:{i}"), l.to_string()))
            .collect();
        let rep = verify_lines(&lines, Some(&vk)).unwrap();
        assert_eq!(rep.signed_checkpoints, 1);
    }
}
