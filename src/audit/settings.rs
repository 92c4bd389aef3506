//! Audit log settings, parsed from `meshca serve`'s flags by `config`.

use std::path::PathBuf;
use std::time::Duration;

use crate::flags::{bounded, bounded_duration, duration_between, err, ConfigError, MAX_PERIOD};

/// Where audit records go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AuditSinkKind {
    Stdout,
    File,
    /// Drops records: benchmarks only, behind `--audit-null-for-benchmarks`.
    #[value(hide = true)]
    Null,
}

/// Audit log settings.
#[derive(Debug, Clone)]
pub struct AuditSettings {
    pub sink: AuditSinkKind,
    pub file: PathBuf,
    pub max_bytes: u64,
    pub max_files: u32,
    /// Rotation never deletes a file holding an issuance record younger than
    /// this (`MESHCA_AUDIT_RETAIN_ISSUED`; zero: files are deleted by count).
    pub retain_issued: Duration,
    pub max_line_bytes: u64,
    pub checkpoint_key: Option<PathBuf>,
    /// The Secret (`namespace`, `name`) holding the checkpoint key under
    /// `key.pem`, created with a new key on the first start
    /// (`MESHCA_AUDIT_CHECKPOINT_KEY_SECRET`).
    pub checkpoint_key_secret: Option<(String, String)>,
    pub checkpoint_every: u64,
    pub checkpoint_interval: Duration,
    /// Writer thread: queue, fsync policy, batch interval.
    pub writer: super::writer::WriterSettings,
    /// Where and how often checkpoints are anchored, when on.
    pub anchor: Option<AnchorTarget>,
    /// Aggregated records of rejected TLS handshakes.
    pub handshakes: HandshakeAudit,
    /// Most keys of the refusal aggregator (`MESHCA_AUDIT_AGGREGATE_MAX_KEYS`).
    pub aggregate_max_keys: usize,
}

/// Where audit checkpoints are anchored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnchorTarget {
    pub namespace: String,
    /// The anchor set (name prefix and label value of its ConfigMaps).
    pub set: String,
    /// At most one periodic anchor this often.
    pub interval: Duration,
}

/// How rejected TLS handshakes are aggregated into audit records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakeAudit {
    pub interval: Duration,
    pub max_sources: usize,
}

impl Default for HandshakeAudit {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            max_sources: 1024,
        }
    }
}

/// Flags of the audit log (`meshca serve`).
#[derive(Debug, Clone, clap::Args)]
pub struct AuditArgs {
    /// Audit sink: `stdout` (JSON lines, nothing else is written there) or `file`.
    #[arg(long, env = "MESHCA_AUDIT_SINK", value_enum, default_value_t = AuditSinkKind::Stdout)]
    pub audit_sink: AuditSinkKind,
    /// Allows the hidden `--audit-sink null`, which drops every record: it
    /// exists only to measure what the audit log costs (docs/BENCHMARKS.md).
    /// A flag with no env var, so no deployment can switch auditing off.
    #[arg(long, hide = true)]
    pub audit_null_for_benchmarks: bool,
    /// Audit file for `--audit-sink file`.
    ///
    /// Rotated by size into `.1`, `.2`, ...; a restart continues the chain.
    #[arg(
        long,
        env = "MESHCA_AUDIT_FILE",
        default_value = "/var/log/meshca/audit.log"
    )]
    pub audit_file: PathBuf,
    /// Rotate the audit file at this size.
    ///
    /// The oldest file beyond MESHCA_AUDIT_MAX_FILES is deleted only when it holds no issuance
    /// record younger than --audit-retain-issued.
    #[arg(long, env = "MESHCA_AUDIT_MAX_BYTES", default_value_t = 100 * 1024 * 1024)]
    pub audit_max_bytes: u64,
    /// Audit files kept (current + rotated). Rotation deletes the oldest
    /// file beyond this count only when it holds no issuance record younger
    /// than --audit-retain-issued.
    #[arg(long, env = "MESHCA_AUDIT_MAX_FILES", default_value_t = 10)]
    pub audit_max_files: u32,
    /// Rotation never deletes a file holding a record of an issued
    /// certificate younger than this, even past --audit-max-files (0s: files
    /// are deleted by count alone). Size the volume for the issuance records
    /// of this long; `meshca_audit_files_retained` shows files kept past the
    /// count.
    ///
    /// At most 10 years. docs/AUDIT.md, Retention.
    #[arg(long, env = "MESHCA_AUDIT_RETAIN_ISSUED", default_value = "24h")]
    pub audit_retain_issued: String,
    /// Longest audit line (bytes, 4096..=1048576). A record over it is
    /// written in a reduced form that says so; it is never dropped.
    #[arg(long, env = "MESHCA_AUDIT_MAX_LINE_BYTES", default_value_t = super::chain::DEFAULT_MAX_LINE_BYTES)]
    pub audit_max_line_bytes: u64,
    /// PKCS#8 PEM key (ECDSA P-256 or Ed25519) that signs audit checkpoints
    /// (`meshca audit keygen` makes one). Without it checkpoints are unsigned.
    #[arg(long, env = "MESHCA_AUDIT_CHECKPOINT_KEY")]
    pub audit_checkpoint_key: Option<PathBuf>,
    /// The checkpoint key as a Secret, `namespace/name` (the PEM under key
    /// `key.pem`): read at start; when it does not exist, meshca generates
    /// a P-256 key and creates the Secret, immutable (replicas starting at
    /// once all take the one created first). Needs get on that Secret and
    /// create on Secrets; an existing Secret is never replaced. Exclusive
    /// with --audit-checkpoint-key.
    #[arg(long, env = "MESHCA_AUDIT_CHECKPOINT_KEY_SECRET")]
    pub audit_checkpoint_key_secret: Option<String>,
    /// Write a checkpoint after this many records.
    #[arg(long, env = "MESHCA_AUDIT_CHECKPOINT_EVERY", default_value_t = 1000)]
    pub audit_checkpoint_every: u64,
    /// Also write a checkpoint this often when records are pending.
    #[arg(long, env = "MESHCA_AUDIT_CHECKPOINT_INTERVAL", default_value = "60s")]
    pub audit_checkpoint_interval: String,
    /// When an audit record counts as written, before its certificate
    /// leaves: `always` (fsync each), `batch` (group commit: one fsync per
    /// batch interval covers every record in it) or `never` (in the kernel).
    /// The stdout sink flushes instead of fsync. docs/AUDIT.md says what each
    /// survives.
    #[arg(long, env = "MESHCA_AUDIT_FSYNC", value_enum, default_value_t = super::writer::FsyncPolicy::Batch)]
    pub audit_fsync: super::writer::FsyncPolicy,
    /// Longest a batch collects records before its fsync (`--audit-fsync batch`).
    ///
    /// At most 1s.
    #[arg(long, env = "MESHCA_AUDIT_FSYNC_BATCH_INTERVAL", default_value = "2ms")]
    pub audit_fsync_batch_interval: String,
    /// Records that may wait for the audit writer; beyond it requests are
    /// shed with UNAVAILABLE (reason audit_queue_full).
    #[arg(long, env = "MESHCA_AUDIT_QUEUE", default_value_t = 4096)]
    pub audit_queue: usize,
    /// Refusals of callers that established no identity (no or a bad client
    /// certificate, token) are written as full records at most this many per
    /// second (as many at once); past it they are folded into aggregate
    /// records per (reason, source address), counts exact. 0 folds every
    /// one. Bounds how fast an unauthenticated flood grows the log.
    ///
    /// 0 to 1000000. Folded records carry `aggregate.source` `unauthenticated`;
    /// `meshca_audit_unauthenticated_folded_total` counts them.
    #[arg(
        long,
        env = "MESHCA_AUDIT_UNAUTHENTICATED_RATE",
        default_value_t = super::writer::DEFAULT_UNAUTHENTICATED_RATE
    )]
    pub audit_unauthenticated_rate: u32,
    /// Rejected TLS handshakes are written as one aggregated `deny` record
    /// per (source IP, reason) this often (1s..=1h).
    ///
    /// Each record has a `count`; reason `tls_handshake_rejected:<code>`.
    #[arg(long, env = "MESHCA_AUDIT_HANDSHAKE_INTERVAL", default_value = "10s")]
    pub audit_handshake_interval: String,
    /// Most (source IP, reason) keys counted per interval; further sources
    /// are counted per reason under the peer `overflow`.
    ///
    /// 1 to 1048576.
    #[arg(
        long,
        env = "MESHCA_AUDIT_HANDSHAKE_MAX_SOURCES",
        default_value_t = 1024
    )]
    pub audit_handshake_max_sources: usize,
    /// Refusals that get no record of their own (the audit queue was full,
    /// or the transport refused before a request existed) are written as one
    /// aggregated `deny` record per (reason, caller identity or source
    /// address), with count and first/last time, this often (100ms..=1h).
    ///
    /// Those are the refusals of the transport's request gate or connection limits before a request
    /// existed, and of a full audit queue. See docs/AUDIT.md.
    #[arg(long, env = "MESHCA_AUDIT_AGGREGATE_INTERVAL", default_value = "1s")]
    pub audit_aggregate_interval: String,
    /// Most (reason, caller) keys named between two aggregate writes; when
    /// it is reached, the callers with the most refusals keep their names
    /// and the others are counted per reason under the peer `overflow`
    /// (totals exact).
    ///
    /// 1 to 1048576.
    #[arg(
        long,
        env = "MESHCA_AUDIT_AGGREGATE_MAX_KEYS",
        default_value_t = super::aggregate::DEFAULT_MAX_KEYS
    )]
    pub audit_aggregate_max_keys: usize,
    /// Anchor audit checkpoints outside the pod: each anchored checkpoint
    /// becomes a new immutable ConfigMap (meshca can create them, never
    /// change or delete one), plus a Kubernetes Event; a stdout run
    /// continues the chain from its newest anchor. Needs Kubernetes.
    ///
    /// Each anchor is named `<set>.<pod>.<run>.<seq>`. The chart turns it on.
    #[arg(long, env = "MESHCA_AUDIT_ANCHOR", default_value_t = false, action = clap::ArgAction::Set)]
    pub audit_anchor: bool,
    /// Namespace of the anchor ConfigMaps (the chart sets meshca's own).
    ///
    /// The chart sets the release namespace.
    #[arg(
        long,
        env = "MESHCA_AUDIT_ANCHOR_NAMESPACE",
        default_value = "istio-system"
    )]
    pub audit_anchor_namespace: String,
    /// The anchor set (one per release): name prefix and label value of
    /// the anchor ConfigMaps.
    ///
    /// At most 120 characters; also the `audit.meshca.io/anchor-set` label. The chart sets
    /// `<fullname>-audit-anchors`.
    #[arg(
        long,
        env = "MESHCA_AUDIT_ANCHOR_CONFIGMAP",
        default_value = "meshca-audit-anchors"
    )]
    pub audit_anchor_configmap: String,
    /// At most one periodic checkpoint is anchored this often (1s to 24h);
    /// start, recovery and shutdown checkpoints always are. Bounds the
    /// anchor objects per replica and day.
    ///
    /// Start, recovery and shutdown anchors are retried. At 60s a busy replica writes at most 1440
    /// anchors (~1.5 MB of etcd) a day.
    #[arg(long, env = "MESHCA_AUDIT_ANCHOR_INTERVAL", default_value = "60s")]
    pub audit_anchor_interval: String,
}

impl AuditArgs {
    /// The audit settings; whether anchoring has Kubernetes is the caller's check.
    pub fn parse(&self) -> Result<AuditSettings, ConfigError> {
        let duration = |name, v: &str| bounded_duration(name, v, false, MAX_PERIOD);
        let checkpoint_interval = duration(
            "MESHCA_AUDIT_CHECKPOINT_INTERVAL",
            &self.audit_checkpoint_interval,
        )?;
        // Rotation renames every kept file in a loop: keep the count sane.
        bounded("MESHCA_AUDIT_MAX_FILES", self.audit_max_files, 1, 10_000)?;
        if self.audit_checkpoint_every == 0 {
            return Err(err(
                "MESHCA_AUDIT_CHECKPOINT_EVERY",
                &self.audit_checkpoint_every.to_string(),
                "checkpoints must be periodic (every > 0, interval > 0)",
            ));
        }
        {
            use super::chain::{MAX_MAX_LINE_BYTES, MIN_MAX_LINE_BYTES};
            if !(MIN_MAX_LINE_BYTES..=MAX_MAX_LINE_BYTES).contains(&self.audit_max_line_bytes) {
                return Err(err(
                    "MESHCA_AUDIT_MAX_LINE_BYTES",
                    &self.audit_max_line_bytes.to_string(),
                    format!("must be between {MIN_MAX_LINE_BYTES} and {MAX_MAX_LINE_BYTES}"),
                ));
            }
        }
        // Every issued certificate may wait this long: at most a second.
        // Retention may be off (0s), or as long as ten years.
        let retain_issued = bounded_duration(
            "MESHCA_AUDIT_RETAIN_ISSUED",
            &self.audit_retain_issued,
            true,
            Duration::from_secs(10 * 366 * 86400),
        )?;
        bounded(
            "MESHCA_AUDIT_UNAUTHENTICATED_RATE",
            self.audit_unauthenticated_rate,
            0,
            1_000_000,
        )?;
        let batch_interval = bounded_duration(
            "MESHCA_AUDIT_FSYNC_BATCH_INTERVAL",
            &self.audit_fsync_batch_interval,
            true,
            Duration::from_secs(1),
        )?;
        // Entries held in memory at once.
        for (name, n) in [
            ("MESHCA_AUDIT_QUEUE", self.audit_queue),
            (
                "MESHCA_AUDIT_HANDSHAKE_MAX_SOURCES",
                self.audit_handshake_max_sources,
            ),
            (
                "MESHCA_AUDIT_AGGREGATE_MAX_KEYS",
                self.audit_aggregate_max_keys,
            ),
        ] {
            bounded(name, n, 1, 1 << 20)?;
        }
        // How often folded refusals are written: at most hourly.
        let fold = |name, v: &str, min| duration_between(name, v, min, Duration::from_secs(3600));
        let handshake_interval = fold(
            "MESHCA_AUDIT_HANDSHAKE_INTERVAL",
            &self.audit_handshake_interval,
            Duration::from_secs(1),
        )?;
        let aggregate_interval = fold(
            "MESHCA_AUDIT_AGGREGATE_INTERVAL",
            &self.audit_aggregate_interval,
            Duration::from_millis(100),
        )?;
        if self.audit_sink == AuditSinkKind::Null && !self.audit_null_for_benchmarks {
            return Err(err(
            "MESHCA_AUDIT_SINK",
            "null",
            "drops every audit record; it is for measuring the audit log's cost and needs --audit-null-for-benchmarks",
        ));
        }
        let mut audit = AuditSettings {
            sink: self.audit_sink,
            file: self.audit_file.clone(),
            max_bytes: self.audit_max_bytes,
            max_files: self.audit_max_files,
            retain_issued,
            max_line_bytes: self.audit_max_line_bytes,
            checkpoint_key: self.audit_checkpoint_key.clone(),
            checkpoint_key_secret: match self.audit_checkpoint_key_secret.as_deref().map(str::trim)
            {
                None | Some("") => None,
                Some(v) => Some(crate::flags::parse_configmap_ref(v).ok_or_else(|| {
                    err(
                        "MESHCA_AUDIT_CHECKPOINT_KEY_SECRET",
                        v,
                        "expected namespace/name",
                    )
                })?),
            },
            checkpoint_every: self.audit_checkpoint_every,
            checkpoint_interval,
            handshakes: HandshakeAudit {
                interval: handshake_interval,
                max_sources: self.audit_handshake_max_sources,
            },
            writer: super::writer::WriterSettings {
                queue: self.audit_queue,
                fsync: self.audit_fsync,
                batch_interval,
                checkpoint_interval,
                aggregate_interval,
                unauthenticated_rate: self.audit_unauthenticated_rate,
            },
            aggregate_max_keys: self.audit_aggregate_max_keys,
            anchor: None,
        };
        if self.audit_anchor {
            super::anchor::check_set_name(&self.audit_anchor_configmap).map_err(|e| {
                err(
                    "MESHCA_AUDIT_ANCHOR_CONFIGMAP",
                    &self.audit_anchor_configmap,
                    e.to_string(),
                )
            })?;
            // Each anchor is an object kept for the retention period.
            let interval = duration_between(
                "MESHCA_AUDIT_ANCHOR_INTERVAL",
                &self.audit_anchor_interval,
                Duration::from_secs(1),
                Duration::from_secs(24 * 3600),
            )?;
            audit.anchor = Some(AnchorTarget {
                namespace: self.audit_anchor_namespace.clone(),
                set: self.audit_anchor_configmap.clone(),
                interval,
            });
        }
        Ok(audit)
    }
}
