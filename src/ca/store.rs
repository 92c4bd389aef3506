//! The live CA: an atomically swapped [`CaBundle`] and the reload loop that
//! follows the files on disk (including Kubernetes Secret symlink swaps).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use notify::Watcher;
use time::OffsetDateTime;
use tokio::sync::watch;

use super::bundle::{CaBundle, MaterialError};

/// Debounce between a file event and the reload (istiod uses 100 ms).
const DEBOUNCE: Duration = Duration::from_millis(100);

/// What happened on a reload attempt.
#[derive(Debug, PartialEq, Eq)]
pub enum ReloadOutcome {
    Unchanged,
    Swapped,
}

/// Durable record of what has been issued, written before a leaf leaves
/// the server (the rotation's issuance mark).
pub trait IssuanceLog: Send + Sync + std::fmt::Debug {
    /// Records that a leaf ending at `not_after` (unix seconds) is issued.
    fn reserve(&self, not_after: i64) -> Result<(), String>;
}

/// A signing CA replaced in a store whose leaves may still be valid: it
/// keeps signing the CRL for them (relying parties match a CRL to a leaf
/// by issuer). Only its issuer (certificate and key) is kept, not the
/// snapshot, so requests draining a replaced snapshot are still countable.
pub struct RetiredIssuer {
    pub issuer: rcgen::Issuer<'static, super::signer::SignerKey>,
    pub signing_cert: rustls_pki_types::CertificateDer<'static>,
    pub not_after: OffsetDateTime,
}

/// Holds the current CA snapshot and swaps it on reload.
pub struct CaStore {
    current: ArcSwap<CaBundle>,
    dir: Option<PathBuf>,
    allow_root_change: bool,
    generation: watch::Sender<u64>,
    issuance: std::sync::OnceLock<Arc<dyn IssuanceLog>>,
    /// How the directory's signing key is held (file or token).
    key_source: super::custody::KeySource,
    /// Keep replaced signers until they expire, for their CRLs (set on the
    /// two-tier issuing store, whose replaced issuing CAs live on a day).
    retain_retired: std::sync::atomic::AtomicBool,
    retired: std::sync::Mutex<Vec<Arc<RetiredIssuer>>>,
}

impl std::fmt::Debug for CaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaStore")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl CaStore {
    /// A store backed by a directory, loaded now.
    pub fn from_dir(dir: &Path, allow_root_change: bool) -> Result<Self, MaterialError> {
        Self::from_dir_with(dir, allow_root_change, Default::default())
    }

    /// A store whose signing key is held as `key_source` says.
    pub fn from_dir_with(
        dir: &Path,
        allow_root_change: bool,
        key_source: super::custody::KeySource,
    ) -> Result<Self, MaterialError> {
        let bundle = key_source.load(dir, OffsetDateTime::now_utc())?;
        let mut store = Self::new(bundle, Some(dir.to_path_buf()), allow_root_change);
        store.key_source = key_source;
        Ok(store)
    }

    pub fn new(bundle: CaBundle, dir: Option<PathBuf>, allow_root_change: bool) -> Self {
        Self {
            current: ArcSwap::from_pointee(bundle),
            dir,
            allow_root_change,
            generation: watch::channel(0).0,
            key_source: Default::default(),
            issuance: std::sync::OnceLock::new(),
            retain_retired: std::sync::atomic::AtomicBool::new(false),
            retired: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// From now on, keeps each replaced signer until its certificate
    /// expires, for [`Self::crl_issuers`].
    pub fn retain_retired_issuers(&self) {
        self.retain_retired
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Every CA whose leaves may still be valid: the current snapshot, and
    /// the replaced signers kept for their CRLs (newest first, unexpired).
    pub fn crl_issuers(&self) -> (Arc<CaBundle>, Vec<Arc<RetiredIssuer>>) {
        let now = OffsetDateTime::now_utc();
        let current = self.snapshot();
        let retired = self
            .retired
            .lock()
            .map(|r| {
                r.iter()
                    .filter(|i| i.not_after > now && i.signing_cert != *current.signing_cert())
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        (current, retired)
    }

    /// Installs the issuance log (once; later calls are ignored).
    pub fn set_issuance_log(&self, log: Arc<dyn IssuanceLog>) {
        let _ = self.issuance.set(log);
    }

    /// Records an issued leaf's end before it is handed out; a failure
    /// withholds the leaf (fail closed: a rotation gate must not miss it).
    pub fn record_issued(&self, not_after: OffsetDateTime) -> Result<(), super::SignError> {
        match self.issuance.get() {
            Some(log) => log
                .reserve(not_after.unix_timestamp())
                .map_err(super::SignError::IssuanceRecord),
            None => Ok(()),
        }
    }

    /// The bundle a request should use from start to finish.
    pub fn snapshot(&self) -> Arc<CaBundle> {
        self.current.load_full()
    }

    /// Bumped on every swap; the TLS layer rebuilds its config from it.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Re-reads the directory; swaps only a complete, verified bundle.
    pub fn reload(&self) -> Result<ReloadOutcome, MaterialError> {
        let Some(dir) = &self.dir else {
            return Ok(ReloadOutcome::Unchanged);
        };
        let m = self.key_source.read(dir)?;
        let old = self.snapshot();
        // Unchanged files are not verified again (polling runs every few
        // seconds). A token key need not be in the fingerprint: it must
        // match the certificate, which is.
        if m.files.fingerprint() == old.fingerprint() {
            return Ok(ReloadOutcome::Unchanged);
        }
        let new = CaBundle::from_files_with(m.files, m.signer, OffsetDateTime::now_utc())?;
        check_root_change(&old, &new, self.allow_root_change)?;
        self.swap(new);
        Ok(ReloadOutcome::Swapped)
    }

    /// Installs a new bundle (also used by tests).
    pub fn swap(&self, bundle: CaBundle) {
        tracing::info!(source = bundle.source(), key_id = bundle.key_id(), signer = %bundle.signer().describe(), not_after = %bundle.signing_not_after(), "CA material loaded");
        let old = self.current.swap(Arc::new(bundle));
        if self
            .retain_retired
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            self.retire(&old);
        }
        self.generation.send_modify(|g| *g += 1);
    }

    fn retire(&self, old: &CaBundle) {
        let now = OffsetDateTime::now_utc();
        let Ok(issuer) = rcgen::Issuer::from_ca_cert_der(
            old.signing_cert(),
            super::signer::SignerKey(old.signer().clone()),
        ) else {
            // It parsed when it was loaded; nothing to keep otherwise.
            return;
        };
        if let Ok(mut r) = self.retired.lock() {
            r.retain(|i| i.not_after > now && i.signing_cert != *old.signing_cert());
            r.insert(
                0,
                Arc::new(RetiredIssuer {
                    issuer,
                    signing_cert: old.signing_cert().clone(),
                    not_after: old.signing_not_after(),
                }),
            );
        }
    }

    /// Follows the directory: file events (debounced) plus a periodic poll
    /// as a safety net for missed events. Runs until the task is dropped.
    pub async fn watch(
        self: Arc<Self>,
        poll: Duration,
        metrics: Option<Arc<super::metrics::CaMetrics>>,
    ) {
        let Some(dir) = self.dir.clone() else { return };
        let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(16);
        let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            // Opening or reading the files (as reload itself does) is no change;
            // reacting to it would reload after every debounce forever.
            if res.is_ok_and(|e| !matches!(e.kind, notify::EventKind::Access(_))) {
                let _ = tx.try_send(());
            }
        })
        .and_then(|mut w| {
            w.watch(&dir, notify::RecursiveMode::NonRecursive)
                .map(|_| w)
        });
        let _watcher = match watcher {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, dir = %dir.display(), "file watch unavailable; polling only");
                None
            }
        };
        let mut ticker = tokio::time::interval(poll);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                Some(()) = rx.recv() => {
                    tokio::time::sleep(DEBOUNCE).await;
                    while rx.try_recv().is_ok() {}
                }
                _ = ticker.tick() => {}
            }
            let store = self.clone();
            // Reading files and probing the key is blocking work.
            let result = tokio::task::spawn_blocking(move || store.reload()).await;
            let outcome = match result {
                Ok(Ok(ReloadOutcome::Swapped)) => Some("swapped"),
                Ok(Ok(ReloadOutcome::Unchanged)) => None,
                Ok(Err(e)) => {
                    tracing::error!(reason = e.reason(), error = %e, "rejected new CA material; still serving the previous bundle");
                    Some(e.reason())
                }
                Err(e) => {
                    tracing::error!(error = %e, "CA reload task failed");
                    Some("task_failed")
                }
            };
            if let (Some(result), Some(m)) = (outcome, &metrics) {
                let labels = crate::metrics::ResultLabels {
                    result: result.to_string(),
                };
                m.ca_reloads.get_or_create(&labels).inc();
            }
        }
    }
}

/// istiod refuses a root change unless multi-root is on, and then only when
/// one root set contains the other.
pub(crate) fn check_root_change(
    old: &CaBundle,
    new: &CaBundle,
    allow: bool,
) -> Result<(), MaterialError> {
    let set = |b: &CaBundle| -> BTreeSet<Vec<u8>> {
        b.roots().iter().map(|c| c.as_ref().to_vec()).collect()
    };
    let (a, b) = (set(old), set(new));
    if a == b || (allow && (a.is_subset(&b) || b.is_subset(&a))) {
        Ok(())
    } else {
        Err(MaterialError::RootChanged)
    }
}
