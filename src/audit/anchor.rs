//! Chain heads anchored outside the pod, append-only. Each anchored
//! checkpoint becomes a new immutable ConfigMap named after its replica, run
//! and seq; meshca may create such objects and read them, never patch,
//! update or delete one, so whoever holds the pod can add to the history
//! but cannot roll it back or remove it. Each anchor is also emitted as a
//! Kubernetes Event. A stdout run continues its chain from its replica's
//! newest anchor; `meshca audit verify --anchors` reads the whole history
//! back; `meshca audit prune-anchors` (an admin, with delete rights meshca
//! lacks) removes anchors past retention.
//!
//! Start, recovery and shutdown checkpoints are always anchored (retried);
//! other checkpoints at most once per `--audit-anchor-interval`, the
//! newest one pending, which bounds the objects per replica and day.
//!
//! Whoever can create ConfigMaps in the namespace can also create objects
//! at the names of a replica's next anchors, or objects that look like its
//! anchors. So a writer whose name is taken writes under a fresh random one
//! (and says so); an object counts as an anchor only at the name and with
//! the labels its own checkpoint gives ([`misplaced`]); and a starting run
//! takes a head only from a checkpoint signed with its own key.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::{ConfigMap, Event, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};
use kube::{Api, Client};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::format::{line_hash, Checkpoint};
use super::keys::{check_signature, VerifyKey};
use super::verify::anchors::{newest_anchor, Anchor};
use super::writer::CheckpointObserver;

/// Label naming the anchor set (the release's) an object belongs to.
pub const LABEL_SET: &str = "audit.meshca.io/anchor-set";
/// Label naming the replica (for people; verify reads the signed line).
pub const LABEL_REPLICA: &str = "audit.meshca.io/replica";
/// Label telling a checkpoint from a published key.
pub const LABEL_KIND: &str = "audit.meshca.io/kind";
/// Data key of the checkpoint line.
pub const DATA_CHECKPOINT: &str = "checkpoint";
/// Data key of a published public key (PEM).
pub const DATA_KEY: &str = "key.pem";
/// Default `--audit-anchor-interval`.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);
/// Longest anchor set name: its objects' names must stay within 253.
pub const MAX_SET_NAME: usize = 120;

/// Checkpoints that are always anchored: a run's start (it links the run to
/// its predecessor), a recovery, and a clean stop.
fn always_anchored(reason: &str) -> bool {
    matches!(reason, "start" | "recovery" | "shutdown")
}

/// Where anchors live and how often periodic ones are written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnchorSettings {
    pub namespace: String,
    /// The anchor set: name prefix and label value of its objects (one per
    /// release).
    pub set: String,
    /// This replica (the pod name).
    pub replica: String,
    /// At most one periodic anchor this often.
    pub interval: Duration,
}

/// Anchoring failed.
#[derive(Debug, thiserror::Error)]
pub enum AnchorError {
    #[error("reading audit anchors in {0}: {1}")]
    Read(String, kube::Error),
    #[error("writing audit anchor {0}: {1}")]
    Write(String, kube::Error),
    #[error("audit anchor {0} already exists with other contents")]
    Conflict(String),
    #[error("deleting audit anchor {0}: {1}")]
    Delete(String, kube::Error),
    #[error("audit anchor set name \"{0}\" is not a lower-case DNS name of at most {MAX_SET_NAME} characters")]
    SetName(String),
    /// An object labelled as this replica's anchor that a starting run
    /// does not continue from.
    #[error("audit anchor {0} not taken as this replica's head: {1}")]
    HeadRejected(String, String),
}

impl AnchorError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Read(..) => "audit_anchor_read_failed",
            Self::Write(..) => "audit_anchor_write_failed",
            Self::Conflict(..) => "audit_anchor_conflict",
            Self::Delete(..) => "audit_anchor_delete_failed",
            Self::SetName(..) => "audit_anchor_set_name",
            Self::HeadRejected(..) => "audit_anchor_head_rejected",
        }
    }
}

/// Checks an anchor set name (a DNS subdomain prefix for the objects).
pub fn check_set_name(set: &str) -> Result<(), AnchorError> {
    let ok = !set.is_empty()
        && set.len() <= MAX_SET_NAME
        && set
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && set.starts_with(|c: char| c.is_ascii_alphanumeric())
        && set.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(AnchorError::SetName(set.to_string()))
    }
}

/// A label value for `s` (at most 63 characters, alphanumeric at both
/// ends): `s` itself when it fits, else a prefix and a hash of the whole.
pub fn label_value(s: &str) -> String {
    let clean = name_part(s);
    if clean == s && s.len() <= 63 {
        return clean;
    }
    let short: String = clean.chars().take(50).collect();
    format!(
        "{}-{}",
        short.trim_end_matches(['-', '.']),
        &line_hash(s)[..12]
    )
}

/// `s` as a name component: lower-case alphanumerics and `-`, at most 63
/// characters, alphanumeric at both ends (uniqueness comes from the run id).
pub fn name_part(s: &str) -> String {
    let mapped: String = s
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    let t = mapped.trim_matches('-');
    if t.is_empty() {
        "x".into()
    } else {
        t.to_string()
    }
}

/// The object holding checkpoint `seq` of `run` on `replica`.
pub fn checkpoint_name(set: &str, replica: &str, run: &str, seq: u64) -> String {
    format!("{set}.{}.{}.{seq}", name_part(replica), name_part(run))
}

/// A fresh name for checkpoint `canonical` when another object holds that
/// name: `<canonical>.<16 hex digits>`, random, so it cannot be taken first.
fn fresh_name(canonical: &str) -> String {
    let mut id = [0u8; 8];
    let _ = aws_lc_rs::rand::fill(&mut id);
    format!("{canonical}.{}", hex::encode(id))
}

/// Why an object of set `set` named `name` with `labels` is not where the
/// checkpoint `line` it holds belongs (`None`: it is, or `line` is no
/// checkpoint, which verify reports on its own). Its name must be the
/// checkpoint's ([`checkpoint_name`]), or that name with the random suffix
/// a writer takes when the name is squatted; its labels must be the set's,
/// `kind=checkpoint` and the checkpoint's replica. An object elsewhere was
/// not written by meshca: someone who can create ConfigMaps put a
/// checkpoint (perhaps another replica's genuine one) there.
pub fn misplaced(
    set: &str,
    name: &str,
    labels: &BTreeMap<String, String>,
    line: &str,
) -> Option<String> {
    let cp = serde_json::from_str::<Checkpoint>(line).ok()?;
    let replica = cp.replica.clone().unwrap_or_default();
    let run = cp.run.clone().unwrap_or_else(|| "v1".into());
    let want = checkpoint_name(set, &replica, &run, cp.seq);
    let suffixed = name
        .strip_prefix(want.as_str())
        .and_then(|rest| rest.strip_prefix('.'))
        .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()));
    if name != want && !suffixed {
        return Some(format!(
            "the object's name is not {want}, the name of the checkpoint it holds (replica {}, run {run}, seq {}): an object squatting on an anchor name, not an anchor meshca wrote",
            replica.escape_debug(),
            cp.seq
        ));
    }
    let label = |k: &str| labels.get(k).map(String::as_str);
    let want_labels = [
        (LABEL_SET, label_value(set)),
        (LABEL_KIND, "checkpoint".to_string()),
        (LABEL_REPLICA, label_value(&replica)),
    ];
    for (k, v) in want_labels {
        if label(k) != Some(v.as_str()) {
            return Some(format!(
                "the object's label {k} is {}, but the checkpoint it holds gives {v}: not an anchor meshca wrote",
                label(k).unwrap_or("(none)").escape_debug()
            ));
        }
    }
    None
}

/// The object publishing the public key `key_id`.
pub fn key_name(set: &str, key_id: &str) -> String {
    format!("{set}.key.{}", name_part(key_id))
}

fn labels(set: &str, kind: &str, replica: Option<&str>) -> BTreeMap<String, String> {
    let mut l = BTreeMap::from([
        (LABEL_SET.to_string(), label_value(set)),
        (LABEL_KIND.to_string(), kind.to_string()),
    ]);
    if let Some(r) = replica {
        l.insert(LABEL_REPLICA.to_string(), label_value(r));
    }
    l
}

/// The immutable object anchoring one checkpoint line.
pub fn checkpoint_object(s: &AnchorSettings, line: &str) -> ConfigMap {
    let (run, seq) = serde_json::from_str::<Checkpoint>(line)
        .map(|cp| (cp.run.unwrap_or_else(|| "v1".into()), cp.seq))
        // Not a checkpoint (cannot happen: the writer hands its own lines):
        // named by its hash, so it is still stored and verify reports it.
        .unwrap_or_else(|_| (line_hash(line)[..16].to_string(), 0));
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(checkpoint_name(&s.set, &s.replica, &run, seq)),
            namespace: Some(s.namespace.clone()),
            labels: Some(labels(&s.set, "checkpoint", Some(&s.replica))),
            ..Default::default()
        },
        immutable: Some(true),
        data: Some(BTreeMap::from([(
            DATA_CHECKPOINT.to_string(),
            line.to_string(),
        )])),
        ..Default::default()
    }
}

/// The immutable object publishing a checkpoint public key.
pub fn key_object(s: &AnchorSettings, key_id: &str, pem: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(key_name(&s.set, key_id)),
            namespace: Some(s.namespace.clone()),
            labels: Some(labels(&s.set, "key", None)),
            ..Default::default()
        },
        immutable: Some(true),
        data: Some(BTreeMap::from([(DATA_KEY.to_string(), pem.to_string())])),
        ..Default::default()
    }
}

/// What the anchor set holds: every anchored checkpoint, and the published
/// public keys as (key_id, PEM).
#[derive(Debug, Default)]
pub struct Fetched {
    pub checkpoints: Vec<Anchor>,
    pub keys: Vec<(String, String)>,
}

fn selector(set: &str, extra: &str) -> ListParams {
    ListParams::default().labels(&format!("{LABEL_SET}={}{extra}", label_value(set)))
}

fn created(cm: &ConfigMap) -> Option<i64> {
    cm.metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
}

fn to_anchor(namespace: &str, set: &str, cm: ConfigMap) -> Anchor {
    let created = created(&cm);
    let name = cm.metadata.name.clone().unwrap_or_default();
    let labels = cm.metadata.labels.clone().unwrap_or_default();
    let line = cm
        .data
        .and_then(|mut d| d.remove(DATA_CHECKPOINT))
        .unwrap_or_default();
    Anchor {
        source: format!("{namespace}/{name}"),
        misplaced: misplaced(set, &name, &labels, &line),
        line,
        created,
    }
}

/// Every object of the anchor set.
async fn list(
    client: &Client,
    namespace: &str,
    set: &str,
    extra: &str,
) -> Result<Vec<ConfigMap>, AnchorError> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let where_ = format!("{namespace} ({LABEL_SET}={})", label_value(set));
    Ok(api
        .list(&selector(set, extra))
        .await
        .map_err(|e| AnchorError::Read(where_, e))?
        .items)
}

/// Every anchored checkpoint and published key of the set.
pub async fn fetch(client: &Client, namespace: &str, set: &str) -> Result<Fetched, AnchorError> {
    let mut out = Fetched::default();
    for cm in list(client, namespace, set, "").await? {
        let kind = cm
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_KIND).cloned());
        if kind.as_deref() == Some("key") {
            let name = cm.metadata.name.clone().unwrap_or_default();
            let id = name.rsplit('.').next().unwrap_or_default().to_string();
            if let Some(pem) = cm.data.and_then(|mut d| d.remove(DATA_KEY)) {
                out.keys.push((id, pem));
            }
        } else {
            out.checkpoints.push(to_anchor(namespace, set, cm));
        }
    }
    Ok(out)
}

/// What a starting run found among the objects labelled as its anchors.
#[derive(Debug, Default)]
pub struct Head {
    /// (seq, line hash) of the newest anchor it continues from.
    pub head: Option<(u64, String)>,
    /// The objects it did not take, and why (each a `HeadRejected`).
    pub rejected: Vec<AnchorError>,
}

/// Whether an anchor may be a head: a checkpoint of `replica` at its own
/// name, signed with `key` (without a key, checkpoints are unsigned and
/// any is taken).
fn head_candidate(a: &Anchor, replica: &str, key: Option<&VerifyKey>) -> Result<(), String> {
    let Ok(cp) = serde_json::from_str::<Checkpoint>(&a.line) else {
        return Err("not a checkpoint line".into());
    };
    if cp.replica.as_deref() != Some(replica) {
        return Err(format!(
            "it holds a checkpoint of replica {}",
            cp.replica.as_deref().unwrap_or("(none)").escape_debug()
        ));
    }
    if let Some(why) = &a.misplaced {
        return Err(why.clone());
    }
    let Some(k) = key else {
        return Ok(());
    };
    let why = if cp.sig.is_none() {
        format!("not signed (alg {})", cp.alg.escape_debug())
    } else {
        match check_signature(&cp, std::slice::from_ref(k)) {
            Ok(true) => return Ok(()),
            Ok(false) => "not checked".into(),
            Err(why) => why,
        }
    };
    Err(format!(
        "{why}: only a checkpoint signed with this replica's checkpoint key is a head"
    ))
}

/// The head a new run continues from: (seq, line hash) of the replica's
/// newest anchor (in the order the history is verified in) among those
/// that are its checkpoints, at their own names, signed with `key`. Every
/// other object labelled as the replica's is logged and returned as
/// rejected (anyone who can create ConfigMaps in the namespace can add
/// one; taking it as the head would make the genuine log fail `verify`).
pub async fn read_head(
    client: &Client,
    s: &AnchorSettings,
    key: Option<&VerifyKey>,
) -> Result<Head, AnchorError> {
    let extra = format!(",{LABEL_REPLICA}={}", label_value(&s.replica));
    let mut out = Head::default();
    let mut anchors = Vec::new();
    for cm in list(client, &s.namespace, &s.set, &extra).await? {
        let a = to_anchor(&s.namespace, &s.set, cm);
        match head_candidate(&a, &s.replica, key) {
            Ok(()) => anchors.push(a),
            Err(why) => {
                let e = AnchorError::HeadRejected(a.source.clone(), why);
                tracing::warn!(error = %e, reason = e.reason(), "an object labelled as this replica's audit anchor is not taken as its head");
                out.rejected.push(e);
            }
        }
    }
    if key.is_none() && !anchors.is_empty() {
        tracing::warn!(
            "no checkpoint key: the anchored head this run continues from cannot be authenticated"
        );
    }
    out.head = newest_anchor(&anchors, &s.replica).map(|(cp, a)| (cp.seq, line_hash(&a.line)));
    Ok(out)
}

/// The audit record saying which objects a starting run did not take as
/// its head (at most 16 named, all counted).
pub fn rejected_heads_record(rejected: &[AnchorError]) -> super::AuditRecord {
    let mut detail = format!(
        "{} object(s) labelled as this replica's audit anchors not taken as its head",
        rejected.len()
    );
    for e in rejected.iter().take(16) {
        detail.push_str("; ");
        detail.push_str(&e.to_string());
    }
    let mut r = super::AuditRecord::new(
        time::OffsetDateTime::now_utc(),
        super::random_id(),
        super::Decision::Deny,
        "audit_anchor_head_rejected".into(),
    );
    r.detail = Some(detail);
    r.count = Some(rejected.len() as u64);
    r.bound();
    r
}

/// Every value of `meshca_audit_anchor_writes_total{result}`: `written`,
/// or the reason of an [`AnchorError`] that writing an anchor can end in.
pub const WRITE_RESULTS: [&str; 4] = [
    "written",
    "audit_anchor_write_failed",
    "audit_anchor_read_failed",
    "audit_anchor_conflict",
];

/// What an anchor writer does next with the checkpoints handed to it. Each
/// queued line carries when the oldest checkpoint it covers was handed
/// over: an anchor pins every checkpoint before it through the chain.
#[derive(Debug, Default)]
pub struct Pending {
    /// Always-anchored lines, oldest first.
    urgent: VecDeque<(String, SystemTime)>,
    /// The newest other checkpoint, waiting for the interval.
    latest: Option<(String, SystemTime)>,
    /// Periodic checkpoints replaced by a newer one before being anchored.
    pub coalesced: u64,
    /// When the oldest checkpoint that no written anchor covers yet was
    /// handed over.
    uncovered_since: Option<SystemTime>,
}

/// The next step of the anchor writer.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// Write this line (`true`: an always-anchored one).
    Write(String, bool),
    /// Nothing is due before this instant.
    WaitUntil(Instant),
    /// Nothing is pending.
    Idle,
}

impl Pending {
    /// Takes a checkpoint line the writer handed over `at`. An
    /// always-anchored one supersedes a pending periodic one (it is newer
    /// and covers it).
    pub fn push(&mut self, line: String, at: SystemTime) {
        let urgent = serde_json::from_str::<Checkpoint>(&line)
            .map(|cp| always_anchored(&cp.reason))
            .unwrap_or(false);
        self.uncovered_since.get_or_insert(at);
        let mut covers = at;
        if let Some((_, t)) = self.latest.take() {
            self.coalesced += 1;
            covers = covers.min(t);
        }
        if urgent {
            self.urgent.push_back((line, covers));
        } else {
            self.latest = Some((line, covers));
        }
    }

    /// The line last taken by [`Pending::next`] was written: what is still
    /// queued was handed over after it, everything before is covered.
    pub fn anchored(&mut self) {
        self.uncovered_since = self
            .urgent
            .iter()
            .chain(&self.latest)
            .map(|(_, t)| *t)
            .min();
    }

    /// When the oldest checkpoint that no written anchor covers was handed
    /// over (`None`: every one is covered). A failed write leaves it as it
    /// was: the next written anchor covers the lost line.
    pub fn uncovered_since(&self) -> Option<SystemTime> {
        self.uncovered_since
    }

    /// What to do at `now`, given when the last anchor was written. With
    /// `flush` (the writer has stopped) a pending periodic line is due now.
    pub fn next(
        &mut self,
        now: Instant,
        last_write: Option<Instant>,
        interval: Duration,
        flush: bool,
    ) -> Next {
        if let Some((l, _)) = self.urgent.pop_front() {
            return Next::Write(l, true);
        }
        if self.latest.is_none() {
            return Next::Idle;
        }
        let due = last_write.map_or(now, |t| t + interval);
        if flush || due <= now {
            self.latest
                .take()
                .map_or(Next::Idle, |(l, _)| Next::Write(l, false))
        } else {
            Next::WaitUntil(due)
        }
    }
}

/// Feeds checkpoints from the writer thread to an async task that anchors
/// them, so a slow API server never holds the writer.
#[derive(Debug)]
pub struct KubeAnchor {
    tx: mpsc::UnboundedSender<(String, SystemTime)>,
    latest: std::sync::Mutex<Option<String>>,
}

impl CheckpointObserver for KubeAnchor {
    fn checkpoint(&self, line: &str) {
        if let Ok(mut l) = self.latest.lock() {
            *l = Some(line.to_string());
        }
        let _ = self.tx.send((line.to_string(), SystemTime::now()));
    }
}

fn report(metrics: &Option<Arc<dyn AnchorMetrics>>, p: &Pending) {
    if let Some(m) = metrics {
        m.anchor_pending(p.uncovered_since());
    }
}

/// Pauses between attempts at an always-anchored line: doubling from the
/// first to the longest.
const FIRST_RETRY: Duration = Duration::from_millis(200);
const MAX_RETRY: Duration = Duration::from_secs(30);

impl KubeAnchor {
    /// Starts the task; it stops when the anchor is dropped, after writing
    /// what was handed to it (a pending periodic line without waiting).
    /// `public_key`: (key_id, PEM) published first.
    pub fn spawn(
        client: Client,
        s: AnchorSettings,
        public_key: Option<(String, String)>,
        metrics: Option<Arc<dyn AnchorMetrics>>,
    ) -> (Arc<Self>, tokio::task::JoinHandle<()>) {
        let (tx, mut rx) = mpsc::unbounded_channel::<(String, SystemTime)>();

        let task = tokio::spawn(async move {
            if let Some((id, pem)) = public_key {
                if let Err(e) = create_once(&client, &key_object(&s, &id, &pem), DATA_KEY).await {
                    tracing::error!(error = %e, reason = e.reason(), "audit checkpoint public key not published");
                }
            }
            let mut pending = Pending::default();
            let mut last_write: Option<Instant> = None;
            let mut closed = false;
            loop {
                while let Ok((l, at)) = rx.try_recv() {
                    pending.push(l, at);
                }
                report(&metrics, &pending);
                let (line, urgent) =
                    match pending.next(Instant::now(), last_write, s.interval, closed) {
                        Next::Write(l, u) => (l, u),
                        Next::Idle if closed => return,
                        Next::Idle => match rx.recv().await {
                            Some((l, at)) => {
                                pending.push(l, at);
                                continue;
                            }
                            None => {
                                closed = true;
                                continue;
                            }
                        },
                        Next::WaitUntil(t) => {
                            tokio::select! {
                                l = rx.recv() => match l {
                                    Some((l, at)) => pending.push(l, at),
                                    None => closed = true,
                                },
                                _ = tokio::time::sleep_until(t) => {}
                            }
                            continue;
                        }
                    };
                let coalesced = std::mem::take(&mut pending.coalesced);
                if let Some(m) = &metrics {
                    m.anchor_coalesced(coalesced);
                }
                // An always-anchored line is retried until it is written, so
                // the history never shows a run without its start; later
                // lines wait behind it (coalesced), keeping the order.
                let mut pause = FIRST_RETRY;
                let result = loop {
                    let r = write(&client, &s, &line, &metrics).await;
                    if let Some(m) = &metrics {
                        m.anchor_written(r.as_ref().map_err(AnchorError::reason).err());
                    }
                    match r {
                        Err(e) if urgent && !matches!(e, AnchorError::Conflict(_)) => {
                            tracing::warn!(error = %e, retry_in = ?pause, "audit anchor not written; retrying");
                            let sleep = tokio::time::sleep(pause);
                            tokio::pin!(sleep);
                            loop {
                                tokio::select! {
                                    l = rx.recv(), if !closed => match l {
                                        Some((l, at)) => pending.push(l, at),
                                        None => closed = true,
                                    },
                                    _ = &mut sleep => break,
                                }
                            }
                            pause = (pause * 2).min(MAX_RETRY);
                        }
                        r => break r,
                    }
                };
                last_write = Some(Instant::now());
                match result {
                    Ok(()) => pending.anchored(),
                    Err(e) => {
                        tracing::error!(error = %e, reason = e.reason(), set = %s.set, "audit anchor not written");
                    }
                }
                report(&metrics, &pending);
            }
        });
        (
            Arc::new(Self {
                tx,
                latest: std::sync::Mutex::new(None),
            }),
            task,
        )
    }

    /// The newest checkpoint handed over (tests).
    pub fn latest(&self) -> Option<String> {
        self.latest.lock().ok().and_then(|l| l.clone())
    }
}

/// What the anchor writer reports (implemented by the metrics).
pub trait AnchorMetrics: Send + Sync + std::fmt::Debug {
    /// One attempt at writing an anchor: written (`None`) or failed (the
    /// error's reason, one of [`WRITE_RESULTS`]).
    fn anchor_written(&self, failed: Option<&'static str>);
    /// Periodic checkpoints superseded before they were anchored.
    fn anchor_coalesced(&self, n: u64);
    /// When the oldest checkpoint that no written anchor covers yet was
    /// handed over (`None`: all are covered). Up to one interval is normal.
    fn anchor_pending(&self, since: Option<SystemTime>);
}

/// Creates `obj`; when it exists already (a retry whose first response was
/// lost, or a key published by an earlier run) its `data_key` must hold the
/// same value, else the name is taken (`Conflict`). Returns the object as
/// stored.
async fn create_once(
    client: &Client,
    obj: &ConfigMap,
    data_key: &str,
) -> Result<ConfigMap, AnchorError> {
    let ns = obj.metadata.namespace.clone().unwrap_or_default();
    let name = obj.metadata.name.clone().unwrap_or_default();
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let where_ = format!("{ns}/{name}");
    match api.create(&PostParams::default(), obj).await {
        Ok(cm) => Ok(cm),
        Err(kube::Error::Api(s)) if s.code == 409 => {
            let have = api
                .get(&name)
                .await
                .map_err(|e| AnchorError::Read(where_.clone(), e))?;
            let value = |c: &ConfigMap| c.data.as_ref().and_then(|d| d.get(data_key).cloned());
            if value(&have) == value(obj) {
                Ok(have)
            } else {
                Err(AnchorError::Conflict(where_))
            }
        }
        Err(e) => Err(AnchorError::Write(where_, e)),
    }
}

/// Fresh names tried after a squatted one.
const FRESH_NAMES: usize = 4;

/// Stores the line as a new immutable object and emits the Event. When
/// another object holds the checkpoint's name (squatted), the line goes
/// under a fresh random name; each squat is logged and counted as
/// `audit_anchor_conflict`.
async fn write(
    client: &Client,
    s: &AnchorSettings,
    line: &str,
    metrics: &Option<Arc<dyn AnchorMetrics>>,
) -> Result<(), AnchorError> {
    let mut obj = checkpoint_object(s, line);
    let canonical = obj.metadata.name.clone().unwrap_or_default();
    let mut fresh = 0;
    let cm = loop {
        match create_once(client, &obj, DATA_CHECKPOINT).await {
            Err(e @ AnchorError::Conflict(_)) if fresh < FRESH_NAMES => {
                fresh += 1;
                if let Some(m) = metrics {
                    m.anchor_written(Some(e.reason()));
                }
                obj.metadata.name = Some(fresh_name(&canonical));
                tracing::error!(error = %e, reason = e.reason(), fresh_name = ?obj.metadata.name, "another object sits at this audit anchor's name (squatted by whoever can create ConfigMaps here); anchoring under a fresh name");
            }
            r => break r?,
        }
    };
    let name = cm.metadata.name.clone().unwrap_or_default();
    let summary = serde_json::from_str::<Checkpoint>(line)
        .map(|cp| {
            format!(
                "audit checkpoint replica={} run={} seq={} reason={} records={} head={} line_sha256={} key_id={}",
                cp.replica.as_deref().unwrap_or("-"),
                cp.run.as_deref().unwrap_or("-"),
                cp.seq,
                cp.reason,
                cp.records,
                cp.prev,
                line_hash(line),
                cp.key_id.as_deref().unwrap_or("-"),
            )
        })
        .unwrap_or_else(|_| "audit checkpoint".into());
    let mut id = [0u8; 8];
    let _ = aws_lc_rs::rand::fill(&mut id);
    let event = Event {
        metadata: ObjectMeta {
            name: Some(format!("{}.{}", s.set, hex::encode(id))),
            namespace: Some(s.namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("ConfigMap".into()),
            name: Some(name),
            namespace: Some(s.namespace.clone()),
            uid: cm.metadata.uid.clone(),
            ..Default::default()
        },
        reason: Some("AuditCheckpoint".into()),
        message: Some(summary),
        type_: Some("Normal".into()),
        event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
        action: Some("Anchor".into()),
        reporting_component: Some("meshca".into()),
        reporting_instance: Some(s.replica.clone()),
        ..Default::default()
    };
    // The anchor is the object; the Event is a copy for the cluster's own
    // event pipeline, so its failure is logged, not retried.
    if let Err(e) = Api::<Event>::namespaced(client.clone(), &s.namespace)
        .create(&PostParams::default(), &event)
        .await
    {
        tracing::warn!(error = %e, "audit checkpoint Event not created");
    }
    Ok(())
}

/// One object of the set as pruning sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PruneCandidate {
    pub name: String,
    pub uid: Option<String>,
    pub created: Option<i64>,
    /// The replica its signed line names; `None` when it is not a checkpoint.
    pub replica: Option<String>,
    pub seq: u64,
}

/// Which anchors pruning removes: every checkpoint anchor created before
/// `cutoff` (Unix seconds) except each replica's newest, which stays so a
/// continuing run still finds its head and verify still finds the replica.
/// Removing only a prefix of each replica's history keeps the rest whole.
/// Objects that are not checkpoints are removed by age alone.
pub fn prune_plan(objects: &[PruneCandidate], cutoff: i64) -> Vec<&PruneCandidate> {
    let mut newest: BTreeMap<&str, (i64, u64)> = BTreeMap::new();
    for o in objects {
        if let Some(r) = &o.replica {
            let k = (o.created.unwrap_or(i64::MIN), o.seq);
            let e = newest.entry(r.as_str()).or_insert(k);
            if k > *e {
                *e = k;
            }
        }
    }
    objects
        .iter()
        .filter(|o| o.created.is_some_and(|c| c < cutoff))
        .filter(|o| match &o.replica {
            Some(r) => newest.get(r.as_str()) != Some(&(o.created.unwrap_or(i64::MIN), o.seq)),
            None => true,
        })
        .collect()
}

/// What pruning did (or would do, dry).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PruneReport {
    pub checkpoints: usize,
    pub removed: Vec<String>,
}

/// Removes anchors created before `cutoff` (see [`prune_plan`]). Needs list
/// and delete on ConfigMaps: an administrator's credentials, not meshca's.
pub async fn prune(
    client: &Client,
    namespace: &str,
    set: &str,
    cutoff: i64,
    dry_run: bool,
) -> Result<PruneReport, AnchorError> {
    let objects: Vec<PruneCandidate> =
        list(client, namespace, set, &format!(",{LABEL_KIND}=checkpoint"))
            .await?
            .into_iter()
            .map(|cm| {
                let cp = cm
                    .data
                    .as_ref()
                    .and_then(|d| d.get(DATA_CHECKPOINT))
                    .and_then(|l| serde_json::from_str::<Checkpoint>(l).ok());
                PruneCandidate {
                    name: cm.metadata.name.clone().unwrap_or_default(),
                    uid: cm.metadata.uid.clone(),
                    created: created(&cm),
                    replica: cp.as_ref().map(|c| c.replica.clone().unwrap_or_default()),
                    seq: cp.map_or(0, |c| c.seq),
                }
            })
            .collect();
    let plan = prune_plan(&objects, cutoff);
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let mut report = PruneReport {
        checkpoints: objects.len(),
        removed: vec![],
    };
    for o in plan {
        if !dry_run {
            // The uid precondition never removes an object recreated meanwhile.
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: o.uid.clone(),
                    resource_version: None,
                }),
                ..Default::default()
            };
            match api.delete(&o.name, &dp).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => continue,
                Err(e) => return Err(AnchorError::Delete(format!("{namespace}/{}", o.name), e)),
            }
        }
        report.removed.push(o.name.clone());
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case("meshca-0", "meshca-0" ; "a pod name is kept")]
    #[test_case("Meshca_0", "meshca-0" ; "upper case and underscores are mapped")]
    #[test_case("--", "x" ; "nothing left")]
    #[test_case("a.b", "a-b" ; "dots are mapped")]
    fn name_parts(s: &str, want: &str) {
        assert_eq!(name_part(s), want);
    }

    #[test]
    fn names_and_labels_stay_within_the_api_limits() {
        let set = "a".repeat(MAX_SET_NAME);
        check_set_name(&set).unwrap();
        let n = checkpoint_name(&set, &"p".repeat(300), &"f".repeat(16), u64::MAX);
        assert!(n.len() <= 253, "{}", n.len());
        let l = label_value(&set);
        assert!(
            l.len() <= 63 && l.ends_with(|c: char| c.is_ascii_alphanumeric()),
            "{l}"
        );
        assert_ne!(
            label_value(&format!("{set}b")),
            l,
            "long names stay distinct"
        );
        assert_eq!(label_value("meshca-audit-anchors"), "meshca-audit-anchors");
        for bad in [
            "",
            "UPPER",
            "-x",
            "x-",
            "a_b",
            &"a".repeat(MAX_SET_NAME + 1),
        ] {
            assert!(check_set_name(bad).is_err(), "{bad}");
        }
    }

    fn cp(reason: &str, seq: u64) -> String {
        format!(
            r#"{{"type":"checkpoint","seq":{seq},"prev":"p","time":"t","reason":"{reason}","records":0,"alg":"none","key_id":null,"sig":null}}"#
        )
    }

    #[test]
    fn periodic_anchors_wait_for_the_interval_and_the_newest_wins() {
        let t0 = Instant::now();
        let iv = Duration::from_secs(60);
        let mut p = Pending::default();
        p.push(cp("start", 0), at(0));
        assert_eq!(
            p.next(t0, None, iv, false),
            Next::Write(cp("start", 0), true)
        );
        let written = Some(t0);
        p.push(cp("periodic", 5), at(0));
        p.push(cp("periodic", 9), at(0));
        assert_eq!(p.coalesced, 1);
        assert_eq!(p.next(t0, written, iv, false), Next::WaitUntil(t0 + iv));
        assert_eq!(
            p.next(t0 + iv, written, iv, false),
            Next::Write(cp("periodic", 9), false)
        );
        assert_eq!(p.next(t0 + iv, written, iv, false), Next::Idle);
        // A shutdown goes at once and supersedes a waiting periodic one.
        p.push(cp("periodic", 12), at(0));
        p.push(cp("shutdown", 13), at(0));
        assert_eq!(p.coalesced, 2);
        assert_eq!(
            p.next(t0, written, iv, false),
            Next::Write(cp("shutdown", 13), true)
        );
        assert_eq!(p.next(t0, written, iv, false), Next::Idle);
        // Stopping flushes a waiting periodic line.
        p.push(cp("periodic", 20), at(0));
        assert_eq!(
            p.next(t0, written, iv, true),
            Next::Write(cp("periodic", 20), false)
        );
        // Starts and recoveries are never coalesced, and keep their order.
        p.push(cp("recovery", 30), at(0));
        p.push(cp("start", 31), at(0));
        assert_eq!(
            p.next(t0, written, iv, false),
            Next::Write(cp("recovery", 30), true)
        );
        assert_eq!(
            p.next(t0, written, iv, false),
            Next::Write(cp("start", 31), true)
        );
    }

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn uncovered_since_is_the_oldest_checkpoint_no_written_anchor_covers() {
        let (t0, iv) = (Instant::now(), Duration::from_secs(60));
        let mut p = Pending::default();
        assert_eq!(p.uncovered_since(), None);
        p.push(cp("start", 0), at(100));
        assert_eq!(
            p.next(t0, None, iv, false),
            Next::Write(cp("start", 0), true)
        );
        // Handed over while the start was being written: not covered by it.
        p.push(cp("periodic", 1), at(105));
        p.push(cp("periodic", 2), at(130));
        assert_eq!(p.uncovered_since(), Some(at(100)));
        p.anchored();
        assert_eq!(
            p.uncovered_since(),
            Some(at(105)),
            "the coalesced line still waits"
        );
        // A failed write leaves the wait running: the lost line is covered
        // only by the next anchor written.
        assert_eq!(
            p.next(t0 + iv, Some(t0), iv, false),
            Next::Write(cp("periodic", 2), false)
        );
        p.push(cp("periodic", 3), at(170));
        assert_eq!(p.uncovered_since(), Some(at(105)));
        assert_eq!(
            p.next(t0 + iv * 2, Some(t0 + iv), iv, false),
            Next::Write(cp("periodic", 3), false)
        );
        p.anchored();
        assert_eq!(p.uncovered_since(), None);
        // A shutdown superseding a waiting line covers from the older one.
        p.push(cp("periodic", 4), at(200));
        p.push(cp("shutdown", 5), at(210));
        p.push(cp("start", 6), at(220));
        assert_eq!(
            p.next(t0, None, iv, false),
            Next::Write(cp("shutdown", 5), true)
        );
        assert_eq!(p.uncovered_since(), Some(at(200)));
        p.anchored();
        assert_eq!(p.uncovered_since(), Some(at(220)));
    }

    fn cand(name: &str, created: i64, replica: Option<&str>, seq: u64) -> PruneCandidate {
        PruneCandidate {
            name: name.into(),
            uid: None,
            created: Some(created),
            replica: replica.map(str::to_string),
            seq,
        }
    }

    #[test]
    fn pruning_removes_old_anchors_but_keeps_each_replicas_newest() {
        let objects = vec![
            cand("a0", 10, Some("a"), 0),
            cand("a1", 20, Some("a"), 5),
            cand("a2", 100, Some("a"), 9),
            // All of b's anchors are old: its newest stays.
            cand("b0", 10, Some("b"), 0),
            cand("b1", 20, Some("b"), 3),
            // Same second: the higher seq is the newer.
            cand("c0", 30, Some("c"), 1),
            cand("c1", 30, Some("c"), 2),
            cand("junk", 10, None, 0),
        ];
        let names: Vec<&str> = prune_plan(&objects, 50)
            .iter()
            .map(|o| o.name.as_str())
            .collect();
        assert_eq!(names, ["a0", "a1", "b0", "c0", "junk"]);
        assert!(prune_plan(&objects, 0).is_empty());
    }

    fn line_of(replica: &str, run: &str, seq: u64) -> String {
        format!(
            r#"{{"type":"checkpoint","seq":{seq},"prev":"p","time":"t","reason":"start","records":0,"alg":"none","key_id":null,"sig":null,"replica":"{replica}","run":"{run}","count":0,"shed":0}}"#
        )
    }

    /// Whoever can create ConfigMaps in the namespace can create objects at
    /// a replica's anchor names holding someone else's checkpoint: such an
    /// object is misplaced unless name and labels are the ones its own
    /// checkpoint gives (a fresh random suffix, taken when the name was
    /// squatted, included).
    #[test]
    fn an_object_is_an_anchor_only_at_its_checkpoints_name_and_labels() {
        let s = AnchorSettings {
            namespace: "ns".into(),
            set: "set".into(),
            replica: "meshca-0".into(),
            interval: DEFAULT_INTERVAL,
        };
        let mine = line_of("meshca-0", "r1", 7);
        let obj = checkpoint_object(&s, &mine);
        let name = obj.metadata.name.clone().unwrap();
        let labels = obj.metadata.labels.clone().unwrap();
        assert_eq!(name, "set.meshca-0.r1.7");
        let at = |name: &str, labels: &BTreeMap<String, String>, line: &str| {
            misplaced("set", name, labels, line)
        };
        assert_eq!(at(&name, &labels, &mine), None);
        assert_eq!(at(&fresh_name(&name), &labels, &mine), None, "a fresh name");
        // Another replica's genuine line at this replica's next name.
        let other = line_of("meshca-1", "r9", 3);
        let squat = at("set.meshca-0.r1.8", &labels, &other).unwrap();
        assert!(squat.contains("squatting"), "{squat}");
        // The right name for that line, with this replica's label.
        let relabelled = at("set.meshca-1.r9.3", &labels, &other).unwrap();
        assert!(relabelled.contains(LABEL_REPLICA), "{relabelled}");
        // Other names: the next seq, a suffix that is not a fresh name.
        for bad in [
            "set.meshca-0.r1.8",
            "set.meshca-0.r1.7.x",
            "set.meshca-0.r1.7-0123456789abcdef",
            "other.meshca-0.r1.7",
        ] {
            assert!(at(bad, &labels, &mine).is_some(), "{bad}");
        }
        let mut no_kind = labels.clone();
        no_kind.remove(LABEL_KIND);
        assert!(at(&name, &no_kind, &mine).is_some());
        // Not a checkpoint at all: verify says so on its own.
        assert_eq!(at(&name, &labels, "junk"), None);
    }
}
