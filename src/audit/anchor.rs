//! Chain heads anchored outside the pod. At every checkpoint the writer
//! hands the signed checkpoint line to [`KubeAnchor`], which stores it in a
//! ConfigMap under the replica's name (one ConfigMap for the release, so RBAC
//! names exactly one object) and emits a Kubernetes Event, so the head also
//! lands in the cluster's own audit pipeline. On start, a stdout run reads
//! its replica's anchored head and continues the chain from it; `meshca audit
//! verify --anchors` reads the anchors back to cross-check a log.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{ConfigMap, Event, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use tokio::sync::watch;

use super::chain::{line_hash, Checkpoint};
use super::writer::CheckpointObserver;

/// Where anchors live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnchorSettings {
    pub namespace: String,
    /// The ConfigMap (one per release; data key = replica).
    pub configmap: String,
    /// This replica's data key (the pod name).
    pub replica: String,
}

/// Anchoring failed.
#[derive(Debug, thiserror::Error)]
pub enum AnchorError {
    #[error("reading audit anchor ConfigMap {0}: {1}")]
    Read(String, kube::Error),
    #[error("audit anchor {0} for replica {1} is not a checkpoint line")]
    Malformed(String, String),
}

impl AnchorError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Read(..) => "audit_anchor_read_failed",
            Self::Malformed(..) => "audit_anchor_malformed",
        }
    }
}

/// The head a new run continues from: (seq, line hash) of the replica's
/// anchored checkpoint, if any.
pub async fn read_head(
    client: &Client,
    s: &AnchorSettings,
) -> Result<Option<(u64, String)>, AnchorError> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &s.namespace);
    let where_ = format!("{}/{}", s.namespace, s.configmap);
    let cm = api
        .get_opt(&s.configmap)
        .await
        .map_err(|e| AnchorError::Read(where_.clone(), e))?;
    let Some(line) = cm
        .and_then(|c| c.data)
        .and_then(|d| d.get(&s.replica).cloned())
    else {
        return Ok(None);
    };
    let cp: Checkpoint = serde_json::from_str(&line)
        .map_err(|_| AnchorError::Malformed(where_, s.replica.clone()))?;
    Ok(Some((cp.seq, line_hash(&line))))
}

/// Data-key prefix of the public keys a replica publishes beside its head
/// (`key.<key_id>.pem`; a rotated key's entry stays, so its id remains
/// verifiable).
pub const KEY_PREFIX: &str = "key.";

/// What the anchor ConfigMap holds: checkpoints as (`ns/name:replica`,
/// line), and published public keys as (key_id, PEM).
pub type Anchors = (Vec<(String, String)>, Vec<(String, String)>);

/// Every anchored checkpoint and published key in the ConfigMap.
pub async fn fetch(
    client: &Client,
    namespace: &str,
    configmap: &str,
) -> Result<Anchors, AnchorError> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let cm = api
        .get(configmap)
        .await
        .map_err(|e| AnchorError::Read(format!("{namespace}/{configmap}"), e))?;
    let (mut heads, mut keys) = (vec![], vec![]);
    for (k, v) in cm.data.unwrap_or_default() {
        match k
            .strip_prefix(KEY_PREFIX)
            .and_then(|r| r.strip_suffix(".pem"))
        {
            Some(id) => keys.push((id.to_string(), v)),
            None => heads.push((format!("{namespace}/{configmap}:{k}"), v)),
        }
    }
    Ok((heads, keys))
}

/// Feeds checkpoints from the writer thread to an async task that writes
/// them; only the newest pending one is kept (a later head covers an
/// earlier one), so a slow API server never holds the writer.
#[derive(Debug)]
pub struct KubeAnchor {
    tx: watch::Sender<Option<String>>,
}

impl CheckpointObserver for KubeAnchor {
    fn checkpoint(&self, line: &str) {
        self.tx.send_replace(Some(line.to_string()));
    }
}

impl KubeAnchor {
    /// Starts the task; it stops when the anchor is dropped (after writing
    /// the last head it was given).
    /// `public_key`: (key_id, PEM) published beside the heads first.
    pub fn spawn(
        client: Client,
        s: AnchorSettings,
        public_key: Option<(String, String)>,
        metrics: Option<Arc<dyn AnchorMetrics>>,
    ) -> (Arc<Self>, tokio::task::JoinHandle<()>) {
        let (tx, mut rx) = watch::channel(None::<String>);
        let task = tokio::spawn(async move {
            if let Some((id, pem)) = public_key {
                let patch = serde_json::json!({ "data": { format!("{KEY_PREFIX}{id}.pem"): pem } });
                let api: Api<ConfigMap> = Api::namespaced(client.clone(), &s.namespace);
                if let Err(e) = api
                    .patch(&s.configmap, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    tracing::error!(error = %e, "audit checkpoint public key not published");
                }
            }
            loop {
                let line = rx.borrow_and_update().clone();
                if let Some(line) = line {
                    let r = write(&client, &s, &line).await;
                    if let Some(m) = &metrics {
                        m.anchor_written(r.is_ok());
                    }
                    if let Err(e) = r {
                        tracing::error!(error = %e, configmap = %s.configmap, "audit anchor not written");
                    }
                }
                if rx.changed().await.is_err() {
                    // Sender gone: a head that came in meanwhile was
                    // written by the loop above before this point.
                    let last = rx.borrow_and_update().clone();
                    if let Some(line) = last {
                        let _ = write(&client, &s, &line).await;
                    }
                    return;
                }
            }
        });
        (Arc::new(Self { tx }), task)
    }

    /// The newest head handed over (tests).
    pub fn latest(&self) -> Option<String> {
        self.tx.borrow().clone()
    }
}

/// Counts anchor writes (implemented by the metrics).
pub trait AnchorMetrics: Send + Sync + std::fmt::Debug {
    fn anchor_written(&self, ok: bool);
}

/// Stores the line under the replica's key (a merge patch touches no other
/// replica's key) and emits the Event.
async fn write(client: &Client, s: &AnchorSettings, line: &str) -> Result<(), kube::Error> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &s.namespace);
    let patch = serde_json::json!({ "data": { s.replica.clone(): line } });
    let cm = api
        .patch(&s.configmap, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
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
    let now = time_now();
    let event = Event {
        metadata: ObjectMeta {
            name: Some(format!("{}.{}", s.configmap, hex::encode(id))),
            namespace: Some(s.namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("ConfigMap".into()),
            name: Some(s.configmap.clone()),
            namespace: Some(s.namespace.clone()),
            uid: cm.metadata.uid.clone(),
            field_path: Some(format!("data[{}]", s.replica)),
            ..Default::default()
        },
        reason: Some("AuditCheckpoint".into()),
        message: Some(summary),
        type_: Some("Normal".into()),
        event_time: Some(MicroTime(now)),
        action: Some("Anchor".into()),
        reporting_component: Some("meshca".into()),
        reporting_instance: Some(s.replica.clone()),
        ..Default::default()
    };
    Api::<Event>::namespaced(client.clone(), &s.namespace)
        .create(&PostParams::default(), &event)
        .await?;
    Ok(())
}

fn time_now() -> k8s_openapi::jiff::Timestamp {
    k8s_openapi::jiff::Timestamp::now()
}
