//! The hash-chained audit writer. Each line carries `seq` and `prev` (the
//! SHA-256 of the previous line's bytes); checkpoint lines, signed with an
//! operator-configured key, commit to the chain head so that removing,
//! editing or reordering records is detectable by `meshca audit verify`.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use aws_lc_rs::signature::{self, EcdsaKeyPair, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use base64::Engine;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{PrivateKeyDer, SubjectPublicKeyInfoDer};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use super::bounded::{bound_opt, bound_string, MIN_MAX};
use super::sha256;
use super::verify::parse_line;
use super::{AuditError, AuditRecord, AuditSink, Reduced};

/// Default cap on one audit line (`MESHCA_AUDIT_MAX_LINE_BYTES`).
pub const DEFAULT_MAX_LINE_BYTES: u64 = 16 * 1024;
/// Smallest line cap: a reduced record must always fit.
pub const MIN_MAX_LINE_BYTES: u64 = 4096;
/// Largest line cap.
pub const MAX_MAX_LINE_BYTES: u64 = 1024 * 1024;
/// Lines up to this size are parsed in full when the tail is inspected;
/// longer ones (written before the cap existed) are hashed as a stream and
/// only their head is read.
const PARSE_LIMIT: u64 = 1024 * 1024;
/// How far back a damaged tail is searched for the last good line.
const MAX_DAMAGED_LINES: u64 = 10_000;
const MAX_DAMAGED_SCAN: u64 = 64 * 1024 * 1024;

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

/// Hex SHA-256 of a line (without its newline).
pub fn line_hash(line: impl AsRef<[u8]>) -> String {
    hex::encode(sha256(line.as_ref()))
}

/// The key that signs checkpoints: ECDSA P-256 or Ed25519, PKCS#8 PEM.
#[derive(Debug)]
pub enum CheckpointKey {
    EcdsaP256(EcdsaKeyPair),
    Ed25519(Ed25519KeyPair),
}

impl CheckpointKey {
    pub fn from_pem(pem: &[u8]) -> Result<Self, AuditError> {
        let der =
            match PrivateKeyDer::from_pem_slice(pem) {
                Ok(PrivateKeyDer::Pkcs8(k)) => k,
                // What Helm's genPrivateKey "ecdsa" writes (the chart's default key).
                Ok(PrivateKeyDer::Sec1(k)) => {
                    return EcdsaKeyPair::from_private_key_der(
                        &signature::ECDSA_P256_SHA256_ASN1_SIGNING,
                        k.secret_sec1_der(),
                    )
                    .map(Self::EcdsaP256)
                    .map_err(|_| AuditError("checkpoint key: EC key is not P-256".into()))
                }
                Ok(_) => return Err(AuditError(
                    "checkpoint key must be PKCS#8 (BEGIN PRIVATE KEY) or a P-256 EC PRIVATE KEY"
                        .into(),
                )),
                Err(e) => return Err(AuditError(format!("checkpoint key: {e}"))),
            };
        if let Ok(k) = EcdsaKeyPair::from_pkcs8(
            &signature::ECDSA_P256_SHA256_ASN1_SIGNING,
            der.secret_pkcs8_der(),
        ) {
            return Ok(Self::EcdsaP256(k));
        }
        Ed25519KeyPair::from_pkcs8(der.secret_pkcs8_der())
            .map(Self::Ed25519)
            .map_err(|_| AuditError("checkpoint key must be ECDSA P-256 or Ed25519".into()))
    }

    /// Generates a new ECDSA P-256 key as PKCS#8 PEM (`meshca audit keygen`).
    pub fn generate_pem() -> Result<String, AuditError> {
        let doc = EcdsaKeyPair::generate_pkcs8(
            &signature::ECDSA_P256_SHA256_ASN1_SIGNING,
            &aws_lc_rs::rand::SystemRandom::new(),
        )
        .map_err(|_| AuditError("key generation failed".into()))?;
        Ok(super::pem_encode("PRIVATE KEY", doc.as_ref()))
    }

    pub fn alg(&self) -> &'static str {
        match self {
            Self::EcdsaP256(_) => "ecdsa-p256-sha256",
            Self::Ed25519(_) => "ed25519",
        }
    }

    /// The public key as a verifier holds it.
    pub fn verify_key(&self) -> VerifyKey {
        match self {
            Self::EcdsaP256(k) => VerifyKey {
                alg: "ecdsa-p256-sha256",
                public: k.public_key().as_ref().to_vec(),
            },
            Self::Ed25519(k) => VerifyKey {
                alg: "ed25519",
                public: k.public_key().as_ref().to_vec(),
            },
        }
    }

    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, AuditError> {
        match self {
            Self::EcdsaP256(k) => k
                .sign(&aws_lc_rs::rand::SystemRandom::new(), msg)
                .map(|s| s.as_ref().to_vec())
                .map_err(|_| AuditError("checkpoint signing failed".into())),
            Self::Ed25519(k) => Ok(k.sign(msg).as_ref().to_vec()),
        }
    }
}

/// A public key that verifies checkpoint signatures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyKey {
    pub alg: &'static str,
    /// Raw public key (uncompressed EC point or Ed25519 bytes).
    pub public: Vec<u8>,
}

impl VerifyKey {
    /// Reads a `PUBLIC KEY` (SPKI) PEM, or the private key PEM itself.
    pub fn from_pem(pem: &[u8]) -> Result<Self, AuditError> {
        if let Ok(spki) = SubjectPublicKeyInfoDer::from_pem_slice(pem) {
            use x509_parser::prelude::FromDer;
            let (_, parsed) = x509_parser::x509::SubjectPublicKeyInfo::from_der(spki.as_ref())
                .map_err(|_| AuditError("malformed public key".into()))?;
            let alg = match parsed.algorithm.algorithm.to_id_string().as_str() {
                "1.2.840.10045.2.1" => "ecdsa-p256-sha256",
                "1.3.101.112" => "ed25519",
                other => {
                    return Err(AuditError(format!(
                        "unsupported public key algorithm {other}"
                    )))
                }
            };
            return Ok(Self {
                alg,
                public: parsed.subject_public_key.data.to_vec(),
            });
        }
        Ok(CheckpointKey::from_pem(pem)?.verify_key())
    }

    /// Short id written into checkpoints.
    pub fn key_id(&self) -> String {
        hex::encode(&sha256(&self.public)[..8])
    }

    /// `PUBLIC KEY` PEM.
    pub fn to_pem(&self) -> String {
        let spki = match self.alg {
            "ed25519" => [
                &[
                    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
                ][..],
                &self.public,
            ]
            .concat(),
            _ => [
                &[
                    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01,
                    0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
                ][..],
                &self.public,
            ]
            .concat(),
        };
        super::pem_encode("PUBLIC KEY", &spki)
    }

    pub fn verify(&self, msg: &[u8], sig: &[u8]) -> bool {
        let alg: &dyn signature::VerificationAlgorithm = match self.alg {
            "ed25519" => &signature::ED25519,
            _ => &signature::ECDSA_P256_SHA256_ASN1,
        };
        UnparsedPublicKey::new(alg, &self.public)
            .verify(msg, sig)
            .is_ok()
    }
}

/// Where lines are written.
pub enum Output {
    /// Standard output: only audit lines go there (logs go to stderr).
    Stdout,
    /// A file rotated by size: `path`, `path.1`, ... `path.<max_files-1>`.
    File {
        path: PathBuf,
        file: File,
        size: u64,
        max_bytes: u64,
        max_files: u32,
    },
    /// In memory (tests).
    Buffer(Vec<u8>),
    /// Any writer (tests: a disk that fills up part-way through a line).
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

/// Damage not yet described by a recovery checkpoint: bytes in the output
/// after the last good line (found on start, or left by a failed write).
struct Damage {
    found: &'static str,
    /// SHA-256 over the damaged bytes so far.
    digest: aws_lc_rs::digest::Context,
    bytes: u64,
    lines: u64,
    /// The damaged bytes end without a newline: one is written before the
    /// next line, so nothing is ever glued onto a torn line.
    open: bool,
    last_line_bytes: Option<u64>,
    /// Set when the chain restarts in a new file.
    new_segment: Option<(String, String)>,
}

impl std::fmt::Debug for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Damage({}, {} lines, {} bytes)",
            self.found, self.lines, self.bytes
        )
    }
}

impl Damage {
    fn new(found: &'static str) -> Self {
        Self {
            found,
            digest: aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256),
            bytes: 0,
            lines: 0,
            open: false,
            last_line_bytes: None,
            new_segment: None,
        }
    }

    /// Accounts for bytes that reached the output outside the chain.
    fn add(&mut self, written: &[u8]) {
        if written.is_empty() {
            return;
        }
        self.digest.update(written);
        self.bytes += written.len() as u64;
        let newlines = written.iter().filter(|b| **b == b'\n').count() as u64;
        self.lines += newlines;
        self.open = written.last() != Some(&b'\n');
    }

    /// The recovery record, as if the pending newline were already written.
    fn recovery(&self) -> Recovery {
        let mut d = self.digest.clone();
        let (mut bytes, mut lines) = (self.bytes, self.lines);
        if self.open {
            d.update(b"\n");
            bytes += 1;
            lines += 1;
        }
        Recovery {
            found: self.found.into(),
            damaged_lines: lines,
            damaged_bytes: bytes,
            damaged_sha256: hex::encode(d.finish()),
            continued: self.new_segment.is_none(),
            last_line_bytes: self.last_line_bytes,
            old_file: self.new_segment.as_ref().map(|(f, _)| f.clone()),
            old_head: self.new_segment.as_ref().map(|(_, h)| h.clone()),
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
/// batch costs one write(2) instead of one per record (issue 20). The chain
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
}

impl ChainedSink {
    /// A sink writing to `out`; continues the chain from (`seq`, `prev`).
    #[allow(clippy::too_many_arguments)]
    fn new(
        out: Output,
        seq: u64,
        prev: String,
        damage: Option<Damage>,
        key: Option<CheckpointKey>,
        checkpoint_every: u64,
        max_line_bytes: u64,
        run: RunInfo,
        previous_from: &str,
    ) -> Result<Self, AuditError> {
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
            key,
            checkpoint_every: checkpoint_every.max(1),
            max_line_bytes: max_line_bytes.clamp(MIN_MAX_LINE_BYTES, MAX_MAX_LINE_BYTES),
            run,
            shed: Arc::new(AtomicU64::new(0)),
            rotations: AtomicU64::new(0),
            checkpoints: AtomicU64::new(0),
        };
        // Every start is marked, so restarts are visible in the log (a
        // pending recovery is written first).
        sink.checkpoint("start")?;
        Ok(sink)
    }

    pub fn stdout(key: Option<CheckpointKey>, checkpoint_every: u64) -> Result<Self, AuditError> {
        Self::stdout_capped(key, checkpoint_every, DEFAULT_MAX_LINE_BYTES)
    }

    /// Standard output with a line cap.
    pub fn stdout_capped(
        key: Option<CheckpointKey>,
        checkpoint_every: u64,
        max_line_bytes: u64,
    ) -> Result<Self, AuditError> {
        Self::stdout_linked(
            key,
            checkpoint_every,
            max_line_bytes,
            RunInfo::from_env(),
            None,
        )
    }

    /// Standard output continuing from `head` (the previous run's last
    /// line, as anchored outside the pod), or a new chain without one.
    pub fn stdout_linked(
        key: Option<CheckpointKey>,
        checkpoint_every: u64,
        max_line_bytes: u64,
        run: RunInfo,
        head: Option<(u64, String)>,
    ) -> Result<Self, AuditError> {
        let (seq, prev) = head.map_or((0, GENESIS.to_string()), |(s, h)| (s + 1, h));
        Self::new(
            Output::Stdout,
            seq,
            prev,
            None,
            key,
            checkpoint_every,
            max_line_bytes,
            run,
            "anchor",
        )
    }

    pub fn buffer(key: Option<CheckpointKey>, checkpoint_every: u64) -> Result<Self, AuditError> {
        Self::writer_capped(
            Output::Buffer(Vec::new()),
            key,
            checkpoint_every,
            DEFAULT_MAX_LINE_BYTES,
        )
    }

    /// Any output (tests), starting a new chain.
    pub fn writer_capped(
        out: Output,
        key: Option<CheckpointKey>,
        checkpoint_every: u64,
        max_line_bytes: u64,
    ) -> Result<Self, AuditError> {
        Self::writer_linked(
            out,
            key,
            checkpoint_every,
            max_line_bytes,
            RunInfo::from_env(),
            None,
        )
    }

    /// Any output (tests), continuing from `head` as [`Self::stdout_linked`].
    pub fn writer_linked(
        out: Output,
        key: Option<CheckpointKey>,
        checkpoint_every: u64,
        max_line_bytes: u64,
        run: RunInfo,
        head: Option<(u64, String)>,
    ) -> Result<Self, AuditError> {
        let (seq, prev) = head.map_or((0, GENESIS.to_string()), |(s, h)| (s + 1, h));
        Self::new(
            out,
            seq,
            prev,
            None,
            key,
            checkpoint_every,
            max_line_bytes,
            run,
            "anchor",
        )
    }

    /// A rotating file sink with the default line cap.
    pub fn file(
        path: &Path,
        max_bytes: u64,
        max_files: u32,
        key: Option<CheckpointKey>,
        checkpoint_every: u64,
    ) -> Result<Self, AuditError> {
        Self::file_capped(
            path,
            max_bytes,
            max_files,
            key,
            checkpoint_every,
            DEFAULT_MAX_LINE_BYTES,
        )
    }

    /// A rotating file sink. An existing file is continued: the chain picks
    /// up from its last good line. Damage at the end (a torn line, garbage,
    /// an over-cap line) never stops startup: it is left in place and
    /// described by a signed `recovery` checkpoint; if no good line is found
    /// the file is rotated away and a new segment names its old head.
    pub fn file_capped(
        path: &Path,
        max_bytes: u64,
        max_files: u32,
        key: Option<CheckpointKey>,
        checkpoint_every: u64,
        max_line_bytes: u64,
    ) -> Result<Self, AuditError> {
        Self::file_run(
            path,
            max_bytes,
            max_files,
            key,
            checkpoint_every,
            max_line_bytes,
            RunInfo::from_env(),
        )
    }

    /// [`Self::file_capped`] for a given run.
    pub fn file_run(
        path: &Path,
        max_bytes: u64,
        max_files: u32,
        key: Option<CheckpointKey>,
        checkpoint_every: u64,
        max_line_bytes: u64,
        run: RunInfo,
    ) -> Result<Self, AuditError> {
        let io = |e: std::io::Error| AuditError(format!("{}: {e}", path.display()));
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let max_line = max_line_bytes.clamp(MIN_MAX_LINE_BYTES, MAX_MAX_LINE_BYTES);
        let (mut seq, mut prev, mut damage) = (0, GENESIS.to_string(), None);
        if path.exists() {
            match scan_tail(path, max_line).map_err(io)? {
                Tail::Empty => {}
                Tail::Good {
                    next_seq,
                    prev: p,
                    last_line_bytes,
                } => {
                    (seq, prev) = (next_seq, p);
                    if last_line_bytes > max_line {
                        let mut d = Damage::new("oversize_line");
                        d.last_line_bytes = Some(last_line_bytes);
                        damage = Some(d);
                    }
                }
                Tail::Damaged {
                    last_good: Some((s, p)),
                    damage: d,
                } => {
                    tracing::warn!(file = %path.display(), found = d.found, lines = d.lines, "audit log ends in damaged lines; continuing the chain from the last good line and recording a recovery checkpoint");
                    (seq, prev, damage) = (s, p, Some(d));
                }
                Tail::Damaged {
                    last_good: None,
                    damage: mut d,
                } => {
                    let old = format!(
                        "{}.1",
                        path.file_name()
                            .map(|n| n.to_string_lossy().into_owned())
                            .unwrap_or_default()
                    );
                    tracing::warn!(file = %path.display(), found = d.found, moved_to = %old, "audit log has no good line near its end; keeping it and starting a new chain segment");
                    rotate_files(path, max_files.max(2)).map_err(io)?;
                    // The old file's torn end is terminated by the verifier's
                    // reading, not by a write here: count its newline now.
                    if d.open {
                        d.add(b"\n");
                    }
                    let head = d.new_segment.take().map(|(_, h)| h).unwrap_or_default();
                    d.new_segment = Some((old, head));
                    damage = Some(d);
                }
            }
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        let out = Output::File {
            path: path.to_path_buf(),
            file,
            size,
            max_bytes: max_bytes.max(4096),
            max_files: max_files.max(1),
        };
        Self::new(
            out,
            seq,
            prev,
            damage,
            key,
            checkpoint_every,
            max_line,
            run,
            "file",
        )
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

/// `path.<n-2>` → `path.<n-1>`, ..., `path` → `path.1`; the oldest is dropped.
fn rotate_files(path: &Path, max_files: u32) -> std::io::Result<()> {
    let name = |i: u32| -> PathBuf {
        if i == 0 {
            path.to_path_buf()
        } else {
            PathBuf::from(format!("{}.{i}", path.display()))
        }
    };
    if max_files <= 1 {
        return std::fs::remove_file(path).or_else(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Ok(())
            } else {
                Err(e)
            }
        });
    }
    let _ = std::fs::remove_file(name(max_files - 1));
    for i in (0..max_files - 1).rev() {
        if name(i).exists() {
            std::fs::rename(name(i), name(i + 1))?;
        }
    }
    Ok(())
}

/// What the end of an existing log looks like.
#[derive(Debug)]
enum Tail {
    Empty,
    /// The last line is a good chain line.
    Good {
        next_seq: u64,
        prev: String,
        last_line_bytes: u64,
    },
    /// Lines after the last good one (if any was found) are damaged.
    Damaged {
        last_good: Option<(u64, String)>,
        damage: Damage,
    },
}

/// Reads the log backwards, line by line, as bytes (never as text: an
/// offset may fall inside a UTF-8 character), until a good chain line is
/// found. Memory stays bounded by [`PARSE_LIMIT`] whatever the line sizes.
fn scan_tail(path: &Path, max_line: u64) -> std::io::Result<Tail> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    if len == 0 {
        return Ok(Tail::Empty);
    }
    let torn = read_at(&mut f, len - 1, 1)? != b"\n";
    // `end`: exclusive end of the current line's bytes.
    let mut end = if torn { len } else { len - 1 };
    let (mut lines, mut scanned) = (0u64, 0u64);
    let mut first: Option<(&'static str, String, u64)> = None;
    loop {
        let start = prev_newline(&mut f, end)?.map_or(0, |p| p + 1);
        let (good, hash) = classify(&mut f, start, end - start)?;
        let size = end - start;
        if first.is_none() {
            let found = if torn {
                "torn_line"
            } else if size > max_line {
                "oversize_line"
            } else {
                "unparsable_tail"
            };
            first = Some((found, hash.clone(), size));
        }
        if let Some(seq) = good {
            if lines == 0 {
                if torn {
                    // A whole line that lost only its newline: restore it.
                    OpenOptions::new()
                        .append(true)
                        .open(path)?
                        .write_all(b"\n")?;
                }
                return Ok(Tail::Good {
                    next_seq: seq + 1,
                    prev: hash,
                    last_line_bytes: size,
                });
            }
            let damage = damage_from(&mut f, end + 1, len, lines, first)?;
            return Ok(Tail::Damaged {
                last_good: Some((seq + 1, hash)),
                damage,
            });
        }
        lines += 1;
        scanned += size + 1;
        if start == 0 || lines >= MAX_DAMAGED_LINES || scanned >= MAX_DAMAGED_SCAN {
            let mut damage = damage_from(&mut f, start, len, lines, first.clone())?;
            damage.new_segment = first.map(|(_, h, _)| (String::new(), h));
            return Ok(Tail::Damaged {
                last_good: None,
                damage,
            });
        }
        end = start - 1;
    }
}

/// Damage covering bytes `from..len` of the file (`lines` lines).
fn damage_from(
    f: &mut File,
    from: u64,
    len: u64,
    lines: u64,
    first: Option<(&'static str, String, u64)>,
) -> std::io::Result<Damage> {
    let (found, _, last_size) = first.unwrap_or(("unparsable_tail", String::new(), 0));
    let mut d = Damage::new(found);
    if found == "oversize_line" {
        d.last_line_bytes = Some(last_size);
    }
    f.seek(SeekFrom::Start(from))?;
    let mut reader = std::io::Read::take(&mut *f, len - from);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        d.add(&buf[..n]);
    }
    // `add` counted the newlines; a torn last line is counted once its
    // newline is written (see `Damage::recovery`).
    debug_assert!(d.lines + u64::from(d.open) == lines);
    Ok(d)
}

fn read_at(f: &mut File, at: u64, n: u64) -> std::io::Result<Vec<u8>> {
    f.seek(SeekFrom::Start(at))?;
    let mut buf = Vec::with_capacity(n as usize);
    std::io::Read::take(&mut *f, n).read_to_end(&mut buf)?;
    Ok(buf)
}

/// Offset of the last `\n` before `before`, reading backwards in chunks.
fn prev_newline(f: &mut File, before: u64) -> std::io::Result<Option<u64>> {
    const CHUNK: u64 = 64 * 1024;
    let mut end = before;
    while end > 0 {
        let start = end.saturating_sub(CHUNK);
        let buf = read_at(f, start, end - start)?;
        if let Some(i) = buf.iter().rposition(|b| *b == b'\n') {
            return Ok(Some(start + i as u64));
        }
        end = start;
    }
    Ok(None)
}

/// Whether bytes `start..start+len` are a good chain line (its seq), and
/// their hash. Lines over [`PARSE_LIMIT`] are hashed as a stream and judged
/// by their head (`{"type":..,"seq":N,"prev":"<64 hex>"`) and closing brace.
fn classify(f: &mut File, start: u64, len: u64) -> std::io::Result<(Option<u64>, String)> {
    if len <= PARSE_LIMIT {
        let line = read_at(f, start, len)?;
        let seq = parse_line(&line).ok().map(|p| p.seq());
        return Ok((seq, line_hash(&line)));
    }
    let head = read_at(f, start, 256)?;
    let last = read_at(f, start + len - 1, 1)?;
    let mut ctx = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    f.seek(SeekFrom::Start(start))?;
    let mut reader = std::io::Read::take(&mut *f, len);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        ctx.update(&buf[..n]);
    }
    let seq = (last == b"}").then(|| head_seq(&head)).flatten();
    Ok((seq, hex::encode(ctx.finish())))
}

/// The seq of a line from its first bytes, as this writer lays them out.
fn head_seq(head: &[u8]) -> Option<u64> {
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
            ..
        } = &mut st.out
        else {
            return Ok(());
        };
        let (path, max_files) = (path.clone(), *max_files);
        let io = |e: std::io::Error| AuditError(format!("rotating {}: {e}", path.display()));
        if let Some(d) = st.damage.as_mut().filter(|d| d.open) {
            // Terminate a torn line in the file it belongs to.
            file.write_all(b"\n").map_err(io)?;
            d.add(b"\n");
        }
        file.sync_data().map_err(io)?;
        rotate_files(&path, max_files).map_err(io)?;
        self.rotations.fetch_add(1, Ordering::Relaxed);
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

impl ChainedSink {
    /// The audit line for `record` at the chain head, within the line cap:
    /// the full record, or else a reduced form that says so (strings cut
    /// hard, and the full line's size and hash), or else only the decision.
    fn fit(&self, st: &State, record: &AuditRecord) -> Result<String, AuditError> {
        let render = |record: &AuditRecord| {
            serde_json::to_string(&AuditLine {
                kind: "audit",
                seq: st.seq,
                prev: &st.prev,
                record,
            })
            .map_err(|e| AuditError(e.to_string()))
        };
        let cap = self.max_line_bytes as usize;
        let line = render(record)?;
        if line.len() < cap {
            return Ok(line);
        }
        let mut reduced = record.clone();
        reduced.reduced = Some(Reduced {
            line_bytes: line.len() as u64,
            line_sha256: line_hash(&line),
            max_line_bytes: self.max_line_bytes,
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
        let mut line = self.fit(&st, record)?;
        if needs_rotation(&st, line.len()) {
            self.rotate(&mut st)?;
            line = self.fit(&st, record)?;
        }
        self.write_line(&mut st, &line)?;
        st.records += 1;
        st.since_checkpoint += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::verify::{read_lines, verify_lines};
    use crate::audit::Decision;
    use std::sync::Arc;
    use test_case::test_case;

    fn record(i: u64) -> AuditRecord {
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
        let sink =
            ChainedSink::writer_capped(Output::Writer(Box::new(disk.clone())), None, 1000, 16384)
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
        let sink =
            ChainedSink::writer_capped(Output::Writer(Box::new(disk.clone())), None, 1000, 16384)
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
        let sink =
            ChainedSink::writer_capped(Output::Buffer(Vec::new()), None, 1000, 4096).unwrap();
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

    /// Writes a good log of `n` records and returns its bytes.
    fn good_log(path: &Path, n: u64) -> Vec<u8> {
        let sink = ChainedSink::file(path, 1 << 30, 3, None, 1000).unwrap();
        for i in 0..n {
            sink.emit(&record(i)).unwrap();
        }
        drop(sink);
        std::fs::read(path).unwrap()
    }

    fn oversize_good_line(path: &Path) {
        // Written by a sink with a large cap, as versions before the cap did.
        let sink =
            ChainedSink::file_capped(path, 1 << 30, 3, None, 1000, MAX_MAX_LINE_BYTES).unwrap();
        let mut r = record(9);
        r.detail = Some("z".repeat(900 * 1024));
        sink.emit(&r).unwrap();
        drop(sink);
        // Past the full-parse limit: lines are then judged by their head.
        let mut bytes = std::fs::read(path).unwrap();
        let last_start = bytes[..bytes.len() - 1]
            .iter()
            .rposition(|b| *b == b'\n')
            .unwrap()
            + 1;
        let mut line = bytes.split_off(last_start);
        line.pop();
        let line = String::from_utf8(line)
            .unwrap()
            .replace(&"z".repeat(900 * 1024), &"z".repeat(1100 * 1024));
        // Keeps seq and prev (the head) in the writer's field order; the
        // chain continues from it by its own hash.
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        std::fs::write(path, bytes).unwrap();
    }

    #[derive(Debug, PartialEq)]
    enum Want {
        Good,
        GoodOversize,
        Continued(&'static str, u64),
        NewSegment(&'static str, u64),
    }

    #[test_case(b"" as &[u8], 0, Want::Good ; "intact")]
    #[test_case(b"{\"type\":\"audit\",\"seq\":", 0, Want::Continued("torn_line", 1) ; "torn line")]
    #[test_case(b"\xff\xfe\x00garbage\n{not json\n", 0, Want::Continued("unparsable_tail", 2) ; "garbage tail")]
    #[test_case(b"\n", 0, Want::Continued("unparsable_tail", 1) ; "empty line")]
    #[test_case(b"", 1, Want::Continued("oversize_line", 1) ; "oversize garbage line")]
    #[test_case(b"", 2, Want::GoodOversize ; "oversize good line")]
    #[test_case(b"", 3, Want::NewSegment("unparsable_tail", 3) ; "nothing good at all")]
    #[test_case(b"", 4, Want::Good ; "line lost only its newline")]
    fn damaged_tails_are_recovered(append: &[u8], special: u8, want: Want) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        good_log(&path, 3);
        let mut bytes = std::fs::read(&path).unwrap();
        match special {
            1 => {
                bytes.extend_from_slice(&[b'q'; 2 * 1024 * 1024]);
                bytes.push(b'\n');
            }
            2 => {
                oversize_good_line(&path);
                bytes = std::fs::read(&path).unwrap();
            }
            3 => bytes = b"garbage\nmore \xc3\n\xa9garbage\n".to_vec(),
            4 => {
                bytes.pop();
            }
            _ => {}
        }
        bytes.extend_from_slice(append);
        std::fs::write(&path, &bytes).unwrap();
        let before_len = bytes.len();

        let tail = scan_tail(&path, DEFAULT_MAX_LINE_BYTES).unwrap();
        let got = match &tail {
            Tail::Empty => panic!("not empty"),
            Tail::Good {
                last_line_bytes, ..
            } if *last_line_bytes > DEFAULT_MAX_LINE_BYTES => Want::GoodOversize,
            Tail::Good { .. } => Want::Good,
            Tail::Damaged {
                last_good: Some(_),
                damage,
            } => Want::Continued(damage.found, damage.lines + u64::from(damage.open)),
            Tail::Damaged {
                last_good: None,
                damage,
            } => Want::NewSegment(damage.found, damage.lines + u64::from(damage.open)),
        };
        assert_eq!(got, want);
        if special == 4 {
            assert_eq!(
                std::fs::read(&path).unwrap().len(),
                before_len + 1,
                "newline restored"
            );
        }

        // Restart on it: the sink starts, writes, and the log verifies with
        // the recovery reported.
        let sink = ChainedSink::file(&path, 1 << 30, 3, None, 1000).unwrap();
        sink.emit(&record(100)).unwrap();
        sink.checkpoint("shutdown").unwrap();
        drop(sink);
        let mut files = vec![];
        if matches!(want, Want::NewSegment(..)) {
            files.push(dir.path().join("audit.log.1"));
        }
        files.push(path.clone());
        let rep = verify_lines(&read_lines(&files).unwrap(), None).unwrap();
        match want {
            Want::Good => assert!(rep.recoveries.is_empty()),
            Want::GoodOversize => {
                assert_eq!(rep.recoveries.len(), 1);
                assert_eq!(rep.recoveries[0].recovery.found, "oversize_line");
                assert!(rep.recoveries[0].recovery.continued);
            }
            Want::Continued(found, n) | Want::NewSegment(found, n) => {
                let r = &rep.recoveries[0];
                assert_eq!(r.recovery.found, found);
                assert_eq!(r.recovery.damaged_lines, n);
                assert!(r.damaged_lines_checked, "{r}");
                assert_eq!(r.recovery.continued, matches!(want, Want::Continued(..)));
            }
        }
        // The new file alone verifies too.
        verify_lines(&read_lines(&[&path]).unwrap(), None).unwrap_or_else(|f| {
            assert!(matches!(want, Want::Continued(..)), "{f}");
            Default::default()
        });
    }

    #[test]
    fn a_tail_offset_inside_a_utf8_character_is_not_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let sink = ChainedSink::file(&path, 1 << 30, 3, None, 1000).unwrap();
        let mut r = record(0);
        for i in 0..400 {
            // An ASCII prefix of widely varying length moves the window's start
            // around the lines, so it does not depend on the record's exact size.
            r.detail = Some(format!(
                "{}{}",
                "x".repeat((i * 997) % 4000),
                "é".repeat(3000)
            ));
            sink.emit(&r).unwrap();
            let len = std::fs::metadata(&path).unwrap().len();
            if len > 300 * 1024 {
                let b = std::fs::read(&path).unwrap();
                // What the old reader's 256 KiB window started on.
                if b[(len - 256 * 1024) as usize] & 0xC0 == 0x80 {
                    break;
                }
            }
            assert!(i < 399, "never landed mid-character");
        }
        drop(sink);
        assert!(matches!(
            scan_tail(&path, DEFAULT_MAX_LINE_BYTES).unwrap(),
            Tail::Good { .. }
        ));
        let sink = ChainedSink::file(&path, 1 << 30, 3, None, 1000).unwrap();
        sink.emit(&record(1)).unwrap();
        drop(sink);
        let rep = verify_lines(&read_lines(&[&path]).unwrap(), None).unwrap();
        assert_eq!(rep.chain_starts, 1, "one chain across the restart");
    }

    #[test]
    fn a_checkpoint_that_cannot_be_written_keeps_the_record_out_too() {
        // Record-then-Internal: the due checkpoint goes first, so when it
        // fails the record saying `allow` is never written.
        let disk = Disk::default();
        let sink =
            ChainedSink::writer_capped(Output::Writer(Box::new(disk.clone())), None, 1, 16384)
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
        let sink = ChainedSink::file(&path, 1 << 30, 3, None, 2).unwrap();
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
        let sink =
            ChainedSink::writer_capped(Output::Writer(Box::new(out.clone())), None, 4, 16384)
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
        let sink =
            ChainedSink::writer_capped(Output::Writer(Box::new(disk.clone())), None, 1000, 16384)
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
        let sink = ChainedSink::file(&path, 8192, 20, None, 1000).unwrap();
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
        let sink =
            ChainedSink::writer_capped(Output::Buffer(Vec::new()), Some(key), 1, 16384).unwrap();
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
