//! Feeds a [`PodIndex`] from a watch over all pods
//! (`status.phase!=Failed`). Pods are decoded into a wire type that names
//! only the fields the index keeps; the rest of the JSON is skipped.

use std::borrow::Cow;
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Api, Client, Resource};
use serde::Deserialize;

use super::listwatch::{KubeSource, Timing};
use super::{LeanPod, Phase, PodIndex};

/// A pod as decoded from the API server: metadata plus four fields.
#[derive(Debug, Clone, Deserialize)]
pub struct PodWire {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: SpecWire,
    #[serde(default)]
    pub status: StatusWire,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecWire {
    pub node_name: Option<String>,
    pub service_account_name: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusWire {
    pub phase: Option<String>,
    #[serde(rename = "podIPs")]
    pub pod_ips: Option<Vec<PodIpWire>>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct PodIpWire {
    pub ip: String,
}

impl Resource for PodWire {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Pod".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "pods".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl From<PodWire> for LeanPod {
    fn from(p: PodWire) -> Self {
        LeanPod {
            namespace: Arc::from(p.metadata.namespace.unwrap_or_default()),
            name: p.metadata.name.unwrap_or_default().into_boxed_str(),
            uid: p.metadata.uid.unwrap_or_default().into_boxed_str(),
            node: p.spec.node_name.filter(|n| !n.is_empty()).map(Arc::from),
            // The API server defaults serviceAccountName to "default".
            service_account: Arc::from(
                p.spec
                    .service_account_name
                    .unwrap_or_else(|| "default".into()),
            ),
            phase: Phase::parse(p.status.phase.as_deref()),
            pod_ips: p
                .status
                .pod_ips
                .unwrap_or_default()
                .iter()
                .filter_map(|i| i.ip.parse::<IpAddr>().ok())
                .collect(),
            deletion_timestamp: p.metadata.deletion_timestamp.map(|t| t.0.as_second()),
        }
    }
}

/// Watches all pods (`status.phase!=Failed`) forever, with freshness
/// bounded by evidence ([`super::listwatch`]). The index keeps serving its
/// last state while the API server is unreachable, and says how stale it is.
pub async fn run(client: Client, index: Arc<PodIndex>, timing: Timing) {
    let source = KubeSource {
        api: Api::<PodWire>::all(client),
        fields: Some("status.phase!=Failed"),
    };
    super::listwatch::run(source, &index, "pod", LeanPod::from, timing).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_only_needed_fields_from_a_full_pod() {
        let json = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "app-0", "namespace": "demo", "uid": "1234", "labels": {"a": "b"}, "resourceVersion": "7"},
            "spec": {"nodeName": "node-1", "serviceAccountName": "app", "containers": [{"name": "c", "image": "x"}]},
            "status": {"phase": "Running", "podIP": "10.1.0.4", "podIPs": [{"ip": "10.1.0.4"}, {"ip": "fd00::4"}]}
        });
        let pod: LeanPod = serde_json::from_value::<PodWire>(json).unwrap().into();
        assert_eq!(&*pod.namespace, "demo");
        assert_eq!(&*pod.name, "app-0");
        assert_eq!(&*pod.uid, "1234");
        assert_eq!(pod.node.as_deref(), Some("node-1"));
        assert_eq!(&*pod.service_account, "app");
        assert_eq!(pod.phase, Phase::Running);
        assert_eq!(pod.pod_ips.len(), 2);
        assert_eq!(pod.deletion_timestamp, None);
    }

    #[test]
    fn keeps_the_deletion_timestamp() {
        let json = serde_json::json!({
            "metadata": {"name": "p", "namespace": "n", "uid": "u",
                         "deletionTimestamp": "2026-01-02T03:04:05Z", "finalizers": ["x/y"]},
            "spec": {"nodeName": "node-1"}
        });
        let pod: LeanPod = serde_json::from_value::<PodWire>(json).unwrap().into();
        assert_eq!(pod.deletion_timestamp, Some(1_767_323_045));
    }

    #[test]
    fn missing_status_and_sa_default() {
        let json = serde_json::json!({"metadata": {"name": "p", "namespace": "n", "uid": "u"}, "spec": {}});
        let pod: LeanPod = serde_json::from_value::<PodWire>(json).unwrap().into();
        assert_eq!(pod.phase, Phase::Pending);
        assert_eq!(&*pod.service_account, "default");
        assert!(pod.node.is_none());
    }
}
