//! Zero-downtime CA rotation: trust -> switch -> retire, gated by meshca's
//! own issuance data rather than timers.
//!
//! The operator stages the next generation (a `cacerts` or
//! `kubernetes.io/tls` directory) in `MESHCA_ROTATION_NEXT_DIR`. The
//! [`Rotation`] controller reads both directories and the state file on
//! every poll, asks [`phase::settle`] what to serve, and swaps one CA
//! snapshot holding both the signing material and the published roots
//! (one generation per snapshot). Trust reaches clients through the
//! snapshot's root bundle ([`trust`]). Phase changes and forced steps are
//! written to the audit log and exported as metrics.

pub mod metrics;
pub mod phase;
pub mod state;
pub mod trust;

pub use metrics::{RotationMetrics, TransitionLabels};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use time::OffsetDateTime;

use crate::audit::{AuditRecord, AuditSink, Decision as AuditDecision};
use crate::ca::bundle::{BundleFiles, MaterialError};
use crate::ca::custody::{DirRole, KeySource};
use crate::ca::issuing::{IssuingError, TwoTier};
use crate::ca::{CaBundle, CaStore};
use phase::{Generation, Inputs, Phase, Signer, Step, Transition, Trust, Wait};
use state::{ForceRequest, StateError, StateStore};

/// Rotation flags (flattened into `meshca serve`).
#[derive(Debug, Clone, clap::Args)]
pub struct RotationArgs {
    /// Directory of the next CA generation (cacerts or kubernetes.io/tls
    /// layout). Setting it turns the phased rotation on; staging material
    /// there starts one.
    ///
    /// The phases are trust, switch, retire (`meshca rotate status|plan|force`, runbook in
    /// docs/istio.md), evaluated every MESHCA_RELOAD_POLL. Works with the PKCS#11 signer and
    /// two-tier issuing.
    #[arg(long, env = "MESHCA_ROTATION_NEXT_DIR")]
    pub rotation_next_dir: Option<PathBuf>,
    /// Rotation state file (phase and write-ahead issuance mark). Keep it
    /// on a volume that outlives the pod.
    ///
    /// The issuance mark is the latest not_after of any issued leaf. A write failure withholds the
    /// leaf (`sign_issuance_record_failed`).
    #[arg(
        long,
        env = "MESHCA_ROTATION_STATE",
        default_value = "./var/meshca/rotation-state.json"
    )]
    pub rotation_state: PathBuf,
    /// Added to the issuance mark each time it moves: one state write per
    /// this period at most, and gates open up to this much later.
    #[arg(long, env = "MESHCA_ROTATION_MARK_SLACK", default_value = "5m")]
    pub rotation_mark_slack: String,
}

/// Parsed rotation settings.
#[derive(Debug, Clone)]
pub struct RotationSettings {
    pub next_dir: PathBuf,
    pub state_file: PathBuf,
    pub mark_slack: Duration,
}

impl RotationArgs {
    /// `None` when rotation is off. `parse_duration` is the config's
    /// bounded duration parser (flag name, value).
    pub fn parse<E>(
        &self,
        parse_duration: impl Fn(&'static str, &str) -> Result<Duration, E>,
    ) -> Result<Option<RotationSettings>, E> {
        let mark_slack = parse_duration("MESHCA_ROTATION_MARK_SLACK", &self.rotation_mark_slack)?;
        Ok(self
            .rotation_next_dir
            .clone()
            .map(|next_dir| RotationSettings {
                next_dir,
                state_file: self.rotation_state.clone(),
                mark_slack,
            }))
    }
}

/// Why an evaluation could not complete.
#[derive(Debug, thiserror::Error)]
pub enum RotationError {
    #[error("current CA material: {0}")]
    Current(MaterialError),
    #[error("serving material for phase {phase}: {source}")]
    Effective {
        phase: &'static str,
        #[source]
        source: MaterialError,
    },
    #[error("{0}")]
    State(#[from] StateError),
    #[error("rotation blocked ({0}): the material on disk does not match the rotation in progress; still serving the previous snapshot")]
    Blocked(&'static str),
    /// Two-tier issuing could not mint the issuing CA under the new
    /// custody bundle; nothing was swapped.
    #[error("issuing CA for the rotation phase: {0}; still serving the previous snapshot")]
    Issuing(IssuingError),
}

impl RotationError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Current(e) => e.reason(),
            Self::Effective { source, .. } => source.reason(),
            Self::State(e) => e.reason(),
            Self::Blocked(r) => r,
            Self::Issuing(e) => e.reason(),
        }
    }
}

/// What an evaluation found (also what `meshca rotate status` prints).
#[derive(Debug, Clone)]
pub struct Report {
    pub phase: Phase,
    pub waiting: Option<Wait>,
    pub transitions: Vec<Transition>,
    pub blocked: Option<&'static str>,
    pub signer_key_id: String,
    pub trusted_roots: usize,
    pub issued_max_not_after: i64,
    /// The staged directory holds material that does not load (reason).
    pub next_error: Option<String>,
    /// Its reason code (also counted as `meshca_rotation_blocked`).
    pub next_error_reason: Option<&'static str>,
    pub force_ignored: Option<Step>,
    pub progress: phase::Progress,
    /// This evaluation installed a new CA snapshot.
    pub swapped: bool,
}

/// A unix time as RFC 3339 for `rotate status|plan`; the number itself when
/// it is out of range.
fn unix_rfc3339(t: i64) -> String {
    OffsetDateTime::from_unix_timestamp(t)
        .ok()
        .and_then(|d| {
            d.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| t.to_string())
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = unix_rfc3339;
        writeln!(f, "phase: {}", self.phase.as_str())?;
        writeln!(f, "signing key: {}", self.signer_key_id)?;
        writeln!(f, "published roots: {}", self.trusted_roots)?;
        writeln!(f, "issued leaves end by: {}", at(self.issued_max_not_after))?;
        let p = &self.progress;
        for (name, t) in [
            ("trust published", p.trust_started_at),
            ("switched", p.switched_at),
            ("retired", p.retired_at),
        ] {
            if let Some(t) = t {
                writeln!(f, "{name}: {}", at(t))?;
            }
        }
        match &self.waiting {
            Some(w) => {
                write!(f, "waiting for: {}", w.what)?;
                match w.until {
                    Some(u) => writeln!(f, " (until {}; ETA {})", at(u), eta(u))?,
                    None => writeln!(f)?,
                }
            }
            None if self.phase == Phase::Idle => writeln!(
                f,
                "waiting for: a new generation staged in the rotation directory"
            )?,
            None => {}
        }
        if let Some(b) = self.blocked {
            writeln!(f, "BLOCKED: {b}")?;
        }
        if let Some(e) = &self.next_error {
            writeln!(f, "staged material not usable: {e}")?;
        }
        if let Some(s) = self.force_ignored {
            writeln!(f, "force {s:?} ignored: it does not apply to this phase")?;
        }
        Ok(())
    }
}

fn eta(until: i64) -> String {
    let left = until - OffsetDateTime::now_utc().unix_timestamp();
    if left <= 0 {
        "now".into()
    } else {
        crate::ca::ttl::go_duration(left as u64)
    }
}

/// SHA-256 (hex) of each root's DER.
fn generation(b: &CaBundle) -> Generation {
    generation_of(b.key_id(), b.roots())
}

fn generation_of(key_id: &str, roots: &[rustls_pki_types::CertificateDer<'_>]) -> Generation {
    Generation {
        key_id: key_id.to_string(),
        roots: roots
            .iter()
            .map(|r| hex::encode(crate::primitives::sha256(r)))
            .collect(),
    }
}

/// One directory's generation: its files, what the decision needs, and
/// the key that signs with it (`None`: the key text in the files).
struct Gen {
    files: BundleFiles,
    generation: Generation,
    signer: Option<Arc<dyn crate::ca::signer::Signer>>,
}

/// How the directories are read.
#[derive(Clone, Copy)]
enum Reading<'a> {
    /// Fully verified with the key that would sign (the server).
    Verify(&'a KeySource),
    /// For `rotate status|plan`, which may not reach a token: verified with
    /// a key file when the directory has one, else certificates only.
    Status,
}

fn read_gen(
    dir: &Path,
    role: DirRole,
    reading: Reading<'_>,
    now: OffsetDateTime,
) -> Result<Gen, MaterialError> {
    let (files, signer) = match reading {
        Reading::Verify(keys) => {
            let m = keys.read_as(dir, role)?;
            (m.files, m.signer)
        }
        Reading::Status => match BundleFiles::read_dir(dir) {
            Err(MaterialError::Incomplete { missing, .. })
                if missing.iter().all(|f| f == "ca-key.pem" || f == "tls.key") =>
            {
                let files = BundleFiles::read_dir_without_key(dir)?;
                let (key_id, roots) = files.identify()?;
                return Ok(Gen {
                    generation: generation_of(&key_id, &roots),
                    files,
                    signer: None,
                });
            }
            r => (r?, None),
        },
    };
    let bundle = CaBundle::from_files_with(files.clone(), signer.clone(), now)?;
    Ok(Gen {
        files,
        generation: generation(&bundle),
        signer,
    })
}

/// The two directories, read and verified.
struct Material {
    current: Gen,
    next: Option<Gen>,
    /// Why the staged directory is not usable: message and reason code.
    next_error: Option<(String, &'static str)>,
}

fn read_material(
    ca_dir: &Path,
    next_dir: &Path,
    reading: Reading<'_>,
    now: OffsetDateTime,
) -> Result<Material, RotationError> {
    let current =
        read_gen(ca_dir, DirRole::Current, reading, now).map_err(RotationError::Current)?;
    let (next, next_error) = match read_gen(next_dir, DirRole::Staged, reading, now) {
        Err(MaterialError::NotFound(_)) => (None, None),
        Err(e) => (None, Some((format!("{} ({})", e, e.reason()), e.reason()))),
        Ok(g) => (Some(g), None),
    };
    Ok(Material {
        current,
        next,
        next_error,
    })
}

/// Where a generation is installed.
#[derive(Debug, Clone)]
pub enum Install {
    /// Leaves are signed with the custody key itself.
    Direct(Arc<CaStore>),
    /// Leaves are signed by an in-memory issuing CA, re-minted under every
    /// custody swap (a phase that only changes the roots included).
    TwoTier(Arc<TwoTier>),
}

impl Install {
    fn custody(&self) -> Arc<CaBundle> {
        match self {
            Self::Direct(s) => s.snapshot(),
            Self::TwoTier(t) => t.custody().snapshot(),
        }
    }

    /// The store leaves are signed from (where the issuance mark goes).
    fn leaves(&self) -> Arc<CaStore> {
        match self {
            Self::Direct(s) => s.clone(),
            Self::TwoTier(t) => t.store(),
        }
    }

    /// Swaps `bundle` in; returns the replaced leaf-signing snapshots that
    /// requests may still hold. With two-tier issuing the issuing CA is
    /// minted and audited first, and nothing changes if that fails.
    fn install(&self, bundle: CaBundle) -> Result<Vec<Arc<CaBundle>>, RotationError> {
        match self {
            Self::Direct(s) => {
                let old = s.snapshot();
                s.swap(bundle);
                Ok(vec![old])
            }
            Self::TwoTier(t) => t.install_custody(bundle).map_err(RotationError::Issuing),
        }
    }
}

/// The controller of one server.
#[derive(Debug)]
pub struct Rotation {
    settings: RotationSettings,
    ca_dir: PathBuf,
    keys: KeySource,
    target: Install,
    state: Arc<StateStore>,
    audit: Option<Arc<dyn AuditSink>>,
    metrics: Option<Arc<RotationMetrics>>,
    ca_metrics: Option<Arc<crate::ca::metrics::CaMetrics>>,
    allow_root_change: bool,
    max_ttl: Duration,
    /// The last staged-material error logged (logged again only when it changes).
    last_next_error: std::sync::Mutex<Option<String>>,
}

/// Longest wait for requests still signing with a replaced snapshot.
const DRAIN_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Mark(Arc<StateStore>);

impl crate::ca::store::IssuanceLog for Mark {
    fn reserve(&self, not_after: i64) -> Result<(), String> {
        self.0.reserve(not_after).map_err(|e| e.to_string())
    }
}

impl Rotation {
    /// Opens the state and installs the issuance mark on the store leaves
    /// are signed from; call [`Self::evaluate`] next to bring the target
    /// to the phase on disk. `keys` finds each generation's key (a file in
    /// its directory, or a token key). `max_ttl` bounds an unknown mark.
    ///
    /// With two-tier issuing the mark records the leaves the issuing CAs
    /// sign, never an issuing CA's own not_after: the gates wait for
    /// workload credentials (leaves whose holders may lack the new roots;
    /// leaves that chain to the old roots). An issuing CA is no one's
    /// credential; it signs nothing once the next custody swap returns, and
    /// every leaf it signed is in the mark.
    pub fn new(
        settings: RotationSettings,
        ca_dir: &Path,
        keys: KeySource,
        target: Install,
        max_ttl: Duration,
        allow_root_change: bool,
    ) -> Result<Self, RotationError> {
        let now = OffsetDateTime::now_utc();
        let bound = (now + max_ttl)
            .min(target.custody().leaf_not_after_limit())
            .unix_timestamp();
        let state = Arc::new(StateStore::open(
            &settings.state_file,
            settings.mark_slack.as_secs() as i64,
            bound,
        )?);
        target
            .leaves()
            .set_issuance_log(Arc::new(Mark(state.clone())));
        Ok(Self {
            settings,
            ca_dir: ca_dir.to_path_buf(),
            keys,
            target,
            state,
            audit: None,
            metrics: None,
            ca_metrics: None,
            allow_root_change,
            max_ttl,
            last_next_error: std::sync::Mutex::new(None),
        })
    }

    pub fn with_audit(mut self, audit: Arc<dyn AuditSink>) -> Self {
        self.audit = Some(audit);
        self
    }

    pub fn with_metrics(
        mut self,
        metrics: Arc<RotationMetrics>,
        ca_metrics: Arc<crate::ca::metrics::CaMetrics>,
    ) -> Self {
        self.metrics = Some(metrics);
        self.ca_metrics = Some(ca_metrics);
        self
    }

    pub fn state(&self) -> &StateStore {
        &self.state
    }

    /// One pass: read material and state, decide, swap, persist, report.
    pub fn evaluate(&self, force: Option<ForceRequest>) -> Result<Report, RotationError> {
        let now = OffsetDateTime::now_utc();
        let m = read_material(
            &self.ca_dir,
            &self.settings.next_dir,
            Reading::Verify(&self.keys),
            now,
        )?;
        self.note_next_error(m.next_error.as_ref());
        let file = self.state.snapshot();
        let current = m.current.generation.clone();
        let next = m.next.as_ref().map(|g| g.generation.clone());
        let inputs = Inputs {
            now: now.unix_timestamp(),
            current: &current,
            next: next.as_ref(),
            issued_max_not_after: self.state.issued_max_not_after(),
            force: force.as_ref().map(|f| f.step),
        };
        let (d, transitions) = phase::settle(&file.progress, &inputs);
        let mut report = Report {
            phase: d.progress.phase,
            waiting: d.waiting.clone(),
            transitions: transitions.clone(),
            blocked: d.blocked,
            signer_key_id: self.target.custody().key_id().to_string(),
            trusted_roots: self.target.custody().roots().len(),
            issued_max_not_after: inputs.issued_max_not_after,
            next_error: m.next_error.as_ref().map(|(e, _)| e.clone()),
            next_error_reason: m.next_error.as_ref().map(|(_, r)| *r),
            force_ignored: force.as_ref().filter(|_| d.force_ignored).map(|f| f.step),
            progress: d.progress.clone(),
            swapped: false,
        };
        if let Some(reason) = d.blocked {
            if let Some(f) = &force {
                self.audit_force_ignored(f, reason);
            }
            self.observe(&report);
            return Err(RotationError::Blocked(reason));
        }
        // Roots of old and new as text, fixed when trust begins.
        let began = transitions.iter().any(|t| t.to == Phase::Trust);
        let (old_pem, new_pem) = if began {
            let next_roots = m
                .next
                .as_ref()
                .map(|g| g.files.root_bundle.clone())
                .unwrap_or_default();
            (m.current.files.root_bundle.clone(), next_roots)
        } else {
            (file.old_roots_pem.clone(), file.new_roots_pem.clone())
        };
        let new_key = d.progress.new_key_id.clone();
        let signing = match d.signer {
            Signer::Old => &m.current,
            Signer::New => {
                match m
                    .next
                    .as_ref()
                    .filter(|g| Some(g.generation.key_id.as_str()) == new_key.as_deref())
                {
                    Some(g) => g,
                    // decide checked one of the two holds new.
                    None => &m.current,
                }
            }
        };
        let signer_files = signing.files.clone();
        let root_bundle = match (d.trust, d.progress.phase) {
            (_, Phase::Idle) | (Trust::Old, _) => signer_files.root_bundle.clone(),
            (Trust::OldAndNew, _) => trust::union_pem(&old_pem, &new_pem),
            (Trust::New, _) => new_pem.clone(),
        };
        let phase_name = d.progress.phase.as_str();
        // BundleFiles zeroizes its key on drop, so it is edited in place
        // rather than rebuilt with struct update syntax.
        let mut effective = signer_files;
        effective.root_bundle = root_bundle;
        if d.progress.phase != Phase::Idle {
            effective.source = format!("{} [rotation: {phase_name}]", effective.source);
        }
        let mut progress = d.progress.clone();
        let served = self.target.custody();
        if effective.fingerprint() != served.fingerprint() {
            let bundle = CaBundle::from_files_with(effective, signing.signer.clone(), now)
                .map_err(|source| RotationError::Effective {
                    phase: phase_name,
                    source,
                })?;
            // Outside a rotation, a root change in the CA directory keeps
            // istiod's rule (ISTIO_MULTIROOT_MESH).
            if d.progress.phase == Phase::Idle && transitions.is_empty() {
                crate::ca::store::check_root_change(&served, &bundle, self.allow_root_change)
                    .map_err(|source| RotationError::Effective {
                        phase: phase_name,
                        source,
                    })?;
            }
            drop(served);
            let replaced = self.target.install(bundle)?;
            report.swapped = true;
            // A request that took the replaced snapshot just before the
            // swap records its leaf after the mark was read: wait for those
            // to finish, then let the gates cover them too.
            let gates = transitions
                .iter()
                .any(|t| matches!(t.to, Phase::Trust | Phase::Switched));
            if gates {
                let mark = self.drained_mark(replaced, now);
                if began {
                    progress.pre_trust_max_not_after =
                        progress.pre_trust_max_not_after.map(|m| m.max(mark));
                }
                if transitions.iter().any(|t| t.to == Phase::Switched) {
                    progress.old_max_not_after = progress.old_max_not_after.map(|m| m.max(mark));
                }
                report.progress = progress.clone();
            }
        }
        self.state.update(|f| {
            f.progress = progress;
            if f.progress.phase == Phase::Idle {
                f.old_roots_pem.clear();
                f.new_roots_pem.clear();
            } else {
                f.old_roots_pem = old_pem;
                f.new_roots_pem = new_pem;
            }
        })?;
        let served = self.target.custody();
        report.signer_key_id = served.key_id().to_string();
        report.trusted_roots = served.roots().len();
        for t in &transitions {
            self.audit_transition(t, force.as_ref(), &report);
        }
        if let (Some(f), Some(_)) = (&force, report.force_ignored) {
            tracing::warn!(step = ?f.step, phase = phase_name, "forced rotation step does not apply to this phase; ignored");
            self.audit_force_ignored(f, phase_name);
        }
        self.observe(&report);
        Ok(report)
    }

    /// Logs a staged generation that cannot be used (once per distinct
    /// error; the metric counts every evaluation, as a blocked one).
    fn note_next_error(&self, e: Option<&(String, &'static str)>) {
        let Ok(mut last) = self.last_next_error.lock() else {
            return;
        };
        let now = e.map(|(msg, _)| msg.clone());
        if *last != now {
            if let Some((msg, reason)) = e {
                tracing::warn!(reason, error = %msg, dir = %self.settings.next_dir.display(), "staged CA generation is not usable; no rotation starts or proceeds with it");
            }
            *last = now;
        }
    }

    /// The issuance mark once no request holds a `replaced` snapshot any
    /// more (or, after [`DRAIN_WAIT`], the bound every leaf signed until
    /// now obeys).
    fn drained_mark(&self, replaced: Vec<Arc<CaBundle>>, now: OffsetDateTime) -> i64 {
        let start = std::time::Instant::now();
        while replaced.iter().any(|r| Arc::strong_count(r) > 1) {
            if start.elapsed() >= DRAIN_WAIT {
                tracing::warn!(
                    "requests still hold the replaced CA snapshot; gating on now + the longest TTL"
                );
                return self
                    .state
                    .issued_max_not_after()
                    .max((now + self.max_ttl).unix_timestamp());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.state.issued_max_not_after()
    }

    fn observe(&self, r: &Report) {
        let Some(rm) = &self.metrics else { return };
        rm.phase.set(r.phase.number());
        rm.gate_remaining_seconds.set(
            r.waiting
                .as_ref()
                .and_then(|w| w.until)
                .map(|u| (u - OffsetDateTime::now_utc().unix_timestamp()).max(0))
                .unwrap_or(-1),
        );
        rm.trusted_roots.set(r.trusted_roots as i64);
        rm.issued_max_not_after.set(r.issued_max_not_after);
        for t in &r.transitions {
            rm.transitions
                .get_or_create(&TransitionLabels {
                    to: t.to.as_str(),
                    forced: if t.forced { "true" } else { "false" },
                })
                .inc();
        }
        if let Some(b) = r.blocked {
            rm.blocked
                .get_or_create(&crate::metrics::ReasonLabels { reason: b.into() })
                .inc();
        }
        // A staged generation that does not load (e.g. its token key is
        // missing or does not match): the rotation cannot take it.
        if let Some(b) = r.next_error_reason {
            rm.blocked
                .get_or_create(&crate::metrics::ReasonLabels { reason: b.into() })
                .inc();
        }
    }

    fn audit_transition(&self, t: &Transition, force: Option<&ForceRequest>, r: &Report) {
        let Some(sink) = &self.audit else { return };
        let reason = match t.to {
            Phase::Idle => "ca_rotation_complete",
            Phase::Trust => "ca_rotation_trust",
            Phase::Switched => "ca_rotation_switch",
            Phase::Retired => "ca_rotation_retire",
        };
        let mut rec = event(reason);
        rec.issuer_key_id = Some(r.signer_key_id.clone());
        rec.rotation_step = Some(format!("{}->{}", t.from.as_str(), t.to.as_str()));
        let mut detail = format!(
            "published roots: {}; issued leaves end by {}",
            r.trusted_roots, r.issued_max_not_after
        );
        if t.forced {
            if let Some(f) = force {
                rec.rotation_forced = Some(format!("{} ({})", f.by, f.reason));
                detail.push_str("; forced before its gate opened");
            }
        }
        rec.detail = Some(detail);
        emit(sink.as_ref(), rec);
        tracing::info!(
            from = t.from.as_str(),
            to = t.to.as_str(),
            forced = t.forced,
            "CA rotation phase changed"
        );
    }

    fn audit_force_ignored(&self, f: &ForceRequest, phase: &str) {
        let Some(sink) = &self.audit else { return };
        let mut rec = event("ca_rotation_force_ignored");
        rec.decision = AuditDecision::Deny;
        rec.rotation_step = Some(phase.to_string());
        rec.rotation_forced = Some(format!("{:?} by {} ({})", f.step, f.by, f.reason));
        emit(sink.as_ref(), rec);
    }

    /// Re-evaluates every `poll` and on a pending force request, until the
    /// task is dropped.
    pub async fn run(self: Arc<Self>, poll: Duration) {
        let mut ticker = tokio::time::interval(poll);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let me = self.clone();
            let result = tokio::task::spawn_blocking(move || {
                let force = me.state.take_force()?;
                me.evaluate(force)
            })
            .await;
            // Counted like the plain hot reload (meshca_ca_reloads).
            let outcome = match result {
                Ok(Ok(r)) => r.swapped.then_some("swapped"),
                Ok(Err(e)) => {
                    tracing::error!(reason = e.reason(), error = %e, "CA rotation evaluation failed; still serving the previous snapshot");
                    Some(e.reason())
                }
                Err(e) => {
                    tracing::error!(error = %e, "CA rotation task failed");
                    Some("task_failed")
                }
            };
            if let (Some(result), Some(m)) = (outcome, &self.ca_metrics) {
                m.ca_reloads
                    .get_or_create(&crate::metrics::ResultLabels {
                        result: result.to_string(),
                    })
                    .inc();
            }
        }
    }
}

fn event(reason: &str) -> AuditRecord {
    AuditRecord::new(
        OffsetDateTime::now_utc(),
        crate::audit::random_id(),
        AuditDecision::Allow,
        reason.into(),
    )
}

fn emit(sink: &dyn AuditSink, mut rec: AuditRecord) {
    rec.bound();
    if let Err(e) = sink.emit(&rec) {
        tracing::error!(error = %e, reason = %rec.reason, "rotation audit record lost");
    }
}

/// `meshca rotate status`: the phase on disk, re-decided read-only (no
/// swap, no state write).
pub fn status(
    ca_dir: &Path,
    settings: &RotationSettings,
    now: OffsetDateTime,
) -> Result<Report, RotationError> {
    let m = read_material(ca_dir, &settings.next_dir, Reading::Status, now)?;
    let file = state::read_json::<state::StateFile>(&settings.state_file)?.unwrap_or_default();
    let current = m.current.generation.clone();
    let next = m.next.as_ref().map(|g| g.generation.clone());
    let inputs = Inputs {
        now: now.unix_timestamp(),
        current: &current,
        next: next.as_ref(),
        issued_max_not_after: file.issued_max_not_after,
        force: None,
    };
    let d = phase::decide(&file.progress, &inputs);
    let signer = match d.signer {
        Signer::Old => current.key_id.clone(),
        Signer::New => file.progress.new_key_id.clone().unwrap_or_default(),
    };
    Ok(Report {
        phase: file.progress.phase,
        waiting: d.waiting.or_else(|| {
            d.transition.as_ref().map(|t| Wait {
                what: match t.to {
                    Phase::Trust => "the server to publish trust (next poll)",
                    Phase::Switched => "the server to switch signing (next poll)",
                    Phase::Retired => "the server to retire the old roots (next poll)",
                    Phase::Idle => "the server to close the rotation (next poll)",
                },
                until: Some(now.unix_timestamp()),
            })
        }),
        transitions: vec![],
        blocked: d.blocked,
        signer_key_id: signer,
        trusted_roots: match d.trust {
            Trust::Old => current.roots.len(),
            Trust::OldAndNew => {
                let mut all: Vec<String> = file.progress.old_roots.clone();
                all.extend(
                    file.progress
                        .new_roots
                        .iter()
                        .filter(|r| !file.progress.old_roots.contains(r))
                        .cloned(),
                );
                all.len()
            }
            Trust::New => file.progress.new_roots.len(),
        },
        issued_max_not_after: file.issued_max_not_after,
        next_error_reason: m.next_error.as_ref().map(|(_, r)| *r),
        next_error: m.next_error.map(|(e, _)| e),
        force_ignored: None,
        progress: file.progress,
        swapped: false,
    })
}

/// `meshca rotate plan`: the steps still ahead, with the earliest time
/// each can happen. Gates that depend on leaves not yet issued are given
/// as bounds (the longest TTL after the previous step).
pub fn plan(
    ca_dir: &Path,
    settings: &RotationSettings,
    max_ttl: Duration,
    now: OffsetDateTime,
) -> Result<Vec<String>, RotationError> {
    let st = status(ca_dir, settings, now)?;
    let m = read_material(ca_dir, &settings.next_dir, Reading::Status, now)?;
    let at = unix_rfc3339;
    let ttl = max_ttl.as_secs() as i64;
    let n = now.unix_timestamp();
    let p = &st.progress;
    let same_root = |a: &[String], b: &[String]| b.iter().all(|x| a.contains(x));
    let mut out = vec![format!("now: {} ({})", st.phase.as_str(), at(n))];
    if let Some(b) = st.blocked {
        out.push(format!("BLOCKED: {b}"));
        return Ok(out);
    }
    match st.phase {
        Phase::Idle => {
            let Some(next) = &m.next else {
                out.push(
                    "nothing staged: put the next generation in the rotation directory".into(),
                );
                return Ok(out);
            };
            let (cur, nxt) = (&m.current.generation, &next.generation);
            if cur.key_id == nxt.key_id {
                out.push("the staged material is the current material: nothing to do".into());
                return Ok(out);
            }
            let roots_same = same_root(&cur.roots, &nxt.roots);
            let back_same = same_root(&nxt.roots, &cur.roots);
            let switch = if roots_same {
                n
            } else {
                st.issued_max_not_after.max(n)
            };
            out.push(format!("trust: at the next poll, publish {} root(s)", {
                let mut all = cur.roots.clone();
                all.extend(nxt.roots.iter().filter(|r| !cur.roots.contains(r)).cloned());
                all.len()
            }));
            out.push(format!(
                "switch: {} ({})",
                if roots_same {
                    "right after trust (same roots)".into()
                } else {
                    format!("at {} when leaves issued so far have expired", at(switch))
                },
                if roots_same {
                    "no wait".into()
                } else {
                    format!("ETA {}", eta(switch))
                }
            ));
            let retire = if back_same { switch } else { switch + ttl };
            out.push(format!(
                "retire: {}",
                if back_same {
                    "right after switch (no root to drop)".into()
                } else {
                    format!(
                        "no later than {} (leaves signed until the switch must expire)",
                        at(retire)
                    )
                }
            ));
        }
        Phase::Trust => {
            let until = p.pre_trust_max_not_after.unwrap_or(n);
            out.push(format!("switch: at {} (ETA {})", at(until), eta(until)));
            out.push(format!("retire: no later than {}", at(until.max(n) + ttl)));
        }
        Phase::Switched => {
            let until = p.old_max_not_after.unwrap_or(n);
            out.push(format!("retire: at {} (ETA {})", at(until), eta(until)));
        }
        Phase::Retired => {}
    }
    out.push("promote: copy the new generation into the CA directory and empty the rotation directory; the rotation then closes".into());
    Ok(out)
}

/// `meshca rotate force`: leaves a request for the server to apply at its
/// next poll (it audits the step, or that it did not apply).
pub fn request_force(
    settings: &RotationSettings,
    step: Step,
    reason: &str,
    by: &str,
) -> Result<(), StateError> {
    state::write_json(
        &state::force_path(&settings.state_file),
        &ForceRequest {
            step,
            reason: reason.to_string(),
            by: by.to_string(),
            requested_at: OffsetDateTime::now_utc().unix_timestamp(),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::MemorySink;
    use crate::ca::generate::{self, GeneratedCa, InitOptions};
    use crate::rotation::state::ForceRequest;

    fn force(step: Step) -> Option<ForceRequest> {
        Some(ForceRequest {
            step,
            reason: "test".into(),
            by: "test".into(),
            requested_at: 0,
        })
    }

    /// A new intermediate under `ca`'s root with the given path length.
    fn intermediate(ca: &GeneratedCa, path_len: u8) -> GeneratedCa {
        let now = OffsetDateTime::now_utc() - time::Duration::minutes(1);
        let root_key = rcgen::KeyPair::from_pem(&ca.root_key).unwrap();
        let root = rcgen::Issuer::from_ca_cert_pem(&ca.root_cert, root_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = generate::ca_params(
            "next",
            "cluster.local",
            now,
            now + time::Duration::days(1),
            Some(path_len),
        )
        .unwrap();
        p.use_authority_key_identifier_extension = true;
        GeneratedCa {
            ca_cert: p.signed_by(&key, &root).unwrap().pem(),
            ca_key: key.serialize_pem(),
            ..ca.clone()
        }
    }

    /// SHA-256 (hex) of a certificate, for readable failures.
    fn der(pem: &str) -> String {
        use rustls_pki_types::pem::PemObject;
        let c = rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
        hex::encode(crate::primitives::sha256(&c))
    }

    struct Setup {
        _tmp: tempfile::TempDir,
        next_dir: PathBuf,
        two_tier: Arc<TwoTier>,
        rotation: Rotation,
        audit: Arc<MemorySink>,
    }

    async fn setup(gen1: &GeneratedCa) -> Setup {
        let tmp = tempfile::tempdir().unwrap();
        let (ca_dir, next_dir) = (tmp.path().join("ca"), tmp.path().join("next"));
        generate::write_cacerts(&ca_dir, gen1, false).unwrap();
        let keys = KeySource::default();
        let now = OffsetDateTime::now_utc();
        let custody = Arc::new(CaStore::new(keys.load(&ca_dir, now).unwrap(), None, true));
        let audit = Arc::new(MemorySink::default());
        let two_tier = TwoTier::start(custody, Duration::from_secs(3600), audit.clone(), None)
            .await
            .unwrap();
        let settings = RotationSettings {
            next_dir: next_dir.clone(),
            state_file: tmp.path().join("state.json"),
            mark_slack: Duration::from_secs(1),
        };
        let rotation = Rotation::new(
            settings,
            &ca_dir,
            keys,
            Install::TwoTier(two_tier.clone()),
            Duration::from_secs(3600),
            false,
        )
        .unwrap();
        Setup {
            _tmp: tmp,
            next_dir,
            two_tier,
            rotation,
            audit,
        }
    }

    /// The issuing CA serving leaves: the intermediate it chains to, and
    /// how many roots it hands out.
    fn served(t: &TwoTier) -> (String, usize) {
        let b = t.store().snapshot();
        (
            hex::encode(crate::primitives::sha256(&b.intermediates()[1])),
            b.roots().len(),
        )
    }

    /// When an evaluation returns, the phase it persisted is already what
    /// leaves are signed with: the issuing CA was re-minted under the new
    /// custody material in the same step (no background task runs here),
    /// also when only the roots changed; and the mark records the leaves
    /// the issuing store signs.
    #[tokio::test(flavor = "multi_thread")]
    async fn two_tier_serves_each_phase_as_soon_as_it_is_persisted() {
        let now = OffsetDateTime::now_utc() - time::Duration::minutes(1);
        let gen1 = generate::generate(&InitOptions::default(), now).unwrap();
        let gen2 = generate::generate(&InitOptions::default(), now).unwrap();
        let s = setup(&gen1).await;
        assert_eq!(served(&s.two_tier), (der(&gen1.ca_cert), 1));
        generate::write_cacerts(&s.next_dir, &gen2, false).unwrap();
        let rot = &s.rotation;
        let r = tokio::task::block_in_place(|| rot.evaluate(None)).unwrap();
        assert_eq!(r.phase, Phase::Trust);
        assert_eq!(served(&s.two_tier), (der(&gen1.ca_cert), 2), "trust");
        // A leaf the issuing store signs moves the mark the switch records.
        let leaf_end = OffsetDateTime::now_utc() + time::Duration::hours(30);
        s.two_tier.store().record_issued(leaf_end).unwrap();
        let r = tokio::task::block_in_place(|| rot.evaluate(force(Step::Switch))).unwrap();
        assert_eq!(r.phase, Phase::Switched);
        assert_eq!(served(&s.two_tier), (der(&gen2.ca_cert), 2), "switched");
        assert!(r.progress.old_max_not_after.unwrap() >= leaf_end.unix_timestamp());
        let r = tokio::task::block_in_place(|| rot.evaluate(force(Step::Retire))).unwrap();
        assert_eq!(r.phase, Phase::Retired);
        assert_eq!(served(&s.two_tier), (der(&gen2.ca_cert), 1), "retired");
        let minted = s
            .audit
            .records()
            .iter()
            .filter(|r| r.reason == "issuing_ca_issued")
            .count();
        assert_eq!(minted, 4, "one issuing CA at start, one per phase");
    }

    /// A next generation the issuing CA cannot be minted under (path
    /// length 0) stops the switch with the reason; nothing is swapped and
    /// the phase on disk stays.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_switch_whose_issuing_ca_cannot_be_made_changes_nothing() {
        let now = OffsetDateTime::now_utc() - time::Duration::minutes(1);
        let gen1 = generate::generate(&InitOptions::default(), now).unwrap();
        let gen2 = intermediate(&gen1, 0);
        let s = setup(&gen1).await;
        generate::write_cacerts(&s.next_dir, &gen2, false).unwrap();
        let rot = &s.rotation;
        // Same root: trust, then the switch in the same evaluation, which fails.
        let err = tokio::task::block_in_place(|| rot.evaluate(None)).unwrap_err();
        assert_eq!(err.reason(), "issuing_ca_path_length", "{err}");
        assert_eq!(rot.state().snapshot().progress.phase, Phase::Idle);
        assert_eq!(served(&s.two_tier), (der(&gen1.ca_cert), 1));
        assert_eq!(
            s.two_tier.custody().snapshot().key_id(),
            rot.target.custody().key_id()
        );
    }
}
