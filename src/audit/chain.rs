//! The hash-chained audit writer. Each line carries `seq` and `prev` (the
//! SHA-256 of the previous line's bytes); checkpoint lines, signed with an
//! operator-configured key, commit to the chain head so that removing,
//! editing or reordering records is detectable by `meshca audit verify`.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use aws_lc_rs::signature::{self, EcdsaKeyPair, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use base64::Engine;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{PrivateKeyDer, SubjectPublicKeyInfoDer};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use super::{AuditError, AuditRecord, AuditSink};
use crate::ca::csr::sha256;

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

/// A checkpoint line.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
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
}

impl Checkpoint {
    /// The bytes a checkpoint signature covers.
    pub fn message(&self) -> Vec<u8> {
        format!(
            "meshca-audit-checkpoint-v1\n{}\n{}\n{}\n{}\n{}",
            self.seq, self.prev, self.time, self.reason, self.records
        )
        .into_bytes()
    }
}

/// Hex SHA-256 of a line (without its newline).
pub fn line_hash(line: &str) -> String {
    hex::encode(sha256(line.as_bytes()))
}

/// The key that signs checkpoints: ECDSA P-256 or Ed25519, PKCS#8 PEM.
#[derive(Debug)]
pub enum CheckpointKey {
    EcdsaP256(EcdsaKeyPair),
    Ed25519(Ed25519KeyPair),
}

impl CheckpointKey {
    pub fn from_pem(pem: &[u8]) -> Result<Self, AuditError> {
        let der = match PrivateKeyDer::from_pem_slice(pem) {
            Ok(PrivateKeyDer::Pkcs8(k)) => k,
            Ok(_) => {
                return Err(AuditError(
                    "checkpoint key must be PKCS#8 (BEGIN PRIVATE KEY)".into(),
                ))
            }
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
        Ok(crate::ca::generate::pem_encode("PRIVATE KEY", doc.as_ref()))
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
        crate::ca::generate::pem_encode("PUBLIC KEY", &spki)
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
#[derive(Debug)]
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
}

#[derive(Debug)]
struct State {
    out: Output,
    seq: u64,
    prev: String,
    records: u64,
    since_checkpoint: u64,
}

/// The hash-chaining sink.
#[derive(Debug)]
pub struct ChainedSink {
    state: Mutex<State>,
    key: Option<CheckpointKey>,
    checkpoint_every: u64,
}

impl ChainedSink {
    /// A sink writing to `out`; continues the chain from (`seq`, `prev`).
    fn new(
        out: Output,
        seq: u64,
        prev: String,
        key: Option<CheckpointKey>,
        checkpoint_every: u64,
    ) -> Result<Self, AuditError> {
        let sink = Self {
            state: Mutex::new(State {
                out,
                seq,
                prev,
                records: 0,
                since_checkpoint: 0,
            }),
            key,
            checkpoint_every: checkpoint_every.max(1),
        };
        // Every start is marked, so restarts are visible in the log.
        sink.checkpoint("start")?;
        Ok(sink)
    }

    pub fn stdout(key: Option<CheckpointKey>, checkpoint_every: u64) -> Result<Self, AuditError> {
        Self::new(Output::Stdout, 0, GENESIS.into(), key, checkpoint_every)
    }

    pub fn buffer(key: Option<CheckpointKey>, checkpoint_every: u64) -> Result<Self, AuditError> {
        Self::new(
            Output::Buffer(Vec::new()),
            0,
            GENESIS.into(),
            key,
            checkpoint_every,
        )
    }

    /// A rotating file sink. An existing file is continued: the chain picks
    /// up from its last line. A file whose last line is damaged is rotated
    /// away untouched and a new chain starts.
    pub fn file(
        path: &Path,
        max_bytes: u64,
        max_files: u32,
        key: Option<CheckpointKey>,
        checkpoint_every: u64,
    ) -> Result<Self, AuditError> {
        let io = |e: std::io::Error| AuditError(format!("{}: {e}", path.display()));
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let (mut seq, mut prev) = (0, GENESIS.to_string());
        if path.exists() {
            match last_position(path).map_err(io)? {
                Some(Ok((s, p))) => (seq, prev) = (s, p),
                None => {}
                Some(Err(())) => {
                    tracing::error!(file = %path.display(), "audit log ends in a damaged line; rotating it away and starting a new chain");
                    rotate_files(path, max_files.max(2)).map_err(io)?;
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
        Self::new(out, seq, prev, key, checkpoint_every)
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
        };
        if let Some(key) = &self.key {
            cp.alg = key.alg().into();
            cp.key_id = Some(key.verify_key().key_id());
            cp.sig =
                Some(base64::engine::general_purpose::STANDARD.encode(key.sign(&cp.message())?));
        }
        let line = serde_json::to_string(&cp).map_err(|e| AuditError(e.to_string()))?;
        write_line(st, &line)?;
        st.since_checkpoint = 0;
        Ok(())
    }
}

/// Appends one line and advances the chain.
fn write_line(st: &mut State, line: &str) -> Result<(), AuditError> {
    let bytes = line.len() as u64 + 1;
    let mut buf = Vec::with_capacity(line.len() + 1);
    buf.extend_from_slice(line.as_bytes());
    buf.push(b'\n');
    match &mut st.out {
        Output::Stdout => {
            let mut out = std::io::stdout().lock();
            out.write_all(&buf)
                .and_then(|_| out.flush())
                .map_err(|e| AuditError(format!("stdout: {e}")))?;
        }
        Output::File {
            file, size, path, ..
        } => {
            file.write_all(&buf)
                .map_err(|e| AuditError(format!("{}: {e}", path.display())))?;
            *size += bytes;
        }
        Output::Buffer(b) => b.extend_from_slice(&buf),
    }
    st.prev = line_hash(line);
    st.seq += 1;
    Ok(())
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

/// The (next seq, hash) after the last line of an existing log, `None` for
/// an empty file, `Some(Err)` if the last line is damaged.
#[allow(clippy::type_complexity)]
fn last_position(path: &Path) -> std::io::Result<Option<Result<(u64, String), ()>>> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    if len == 0 {
        return Ok(None);
    }
    let start = len.saturating_sub(256 * 1024);
    f.seek(SeekFrom::Start(start))?;
    let mut tail = String::new();
    f.read_to_string(&mut tail)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    if !tail.ends_with('\n') {
        return Ok(Some(Err(())));
    }
    let Some(last) = tail.trim_end_matches('\n').rsplit('\n').next() else {
        return Ok(Some(Err(())));
    };
    #[derive(Deserialize)]
    struct Pos {
        seq: u64,
    }
    Ok(Some(match serde_json::from_str::<Pos>(last) {
        Ok(p) => Ok((p.seq + 1, line_hash(last))),
        Err(_) => Err(()),
    }))
}

fn needs_rotation(st: &State, line_len: usize) -> bool {
    matches!(&st.out, Output::File { size, max_bytes, .. } if *size > 0 && *size + line_len as u64 + 1 > *max_bytes)
}

impl ChainedSink {
    /// Starts a new file whose first line is a `rotation` checkpoint carrying
    /// the chain on (signed when a key is configured), so each file can be
    /// verified on its own from that anchor.
    fn rotate(&self, st: &mut State) -> Result<(), AuditError> {
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
        file.sync_data().map_err(io)?;
        rotate_files(&path, max_files).map_err(io)?;
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
        let render = |seq: u64, prev: &str| {
            serde_json::to_string(&AuditLine {
                kind: "audit",
                seq,
                prev,
                record,
            })
            .map_err(|e| AuditError(e.to_string()))
        };
        let mut line = render(st.seq, &st.prev)?;
        if needs_rotation(&st, line.len()) {
            self.rotate(&mut st)?;
            line = render(st.seq, &st.prev)?;
        }
        write_line(&mut st, &line)?;
        st.records += 1;
        st.since_checkpoint += 1;
        if st.since_checkpoint >= self.checkpoint_every {
            self.write_checkpoint(&mut st, "periodic")?;
        }
        Ok(())
    }
}
