//! The root publisher against the real kube-apiserver (scripts/kube-testenv),
//! running as a ServiceAccount that holds only the publisher's RBAC rules
//! (tests/fixtures/rbac-root-publisher.yaml, the same rules the chart grants).
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{kte, unique, Kte};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use meshca::rootpub::{self, RootPublisherSettings};
use serde_json::json;
use tokio::sync::watch;

const CM: &str = "istio-ca-root-cert";
const ROOT_1: &str = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
const ROOT_2: &str = "-----BEGIN CERTIFICATE-----\nBBBB\n-----END CERTIFICATE-----\n";
const ROOT_3: &str = "-----BEGIN CERTIFICATE-----\nCCCC\n-----END CERTIFICATE-----\n";

/// A client for a fresh ServiceAccount bound to exactly the publisher fixture's rules.
async fn publisher_client(k: &Kte) -> Client {
    let ns = k.namespace("rootpub-sa").await;
    k.service_account(&ns, "publisher").await;
    let fixture = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/rbac-root-publisher.yaml"),
    )
    .unwrap();
    let mut role: ClusterRole = serde_yaml_ng::from_str(&fixture).unwrap();
    role.metadata.name = Some(ns.clone());
    Api::<ClusterRole>::all(k.admin.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ns},
        "subjects": [{"kind": "ServiceAccount", "name": "publisher", "namespace": ns}]
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(k.admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let token = k
        .token(
            &ns,
            "publisher",
            None,
            "https://kubernetes.default.svc.cluster.local",
        )
        .await;
    let mut kc: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(k.meshca_kubeconfig()).unwrap()).unwrap();
    kc["users"][0]["user"] = serde_yaml_ng::to_value(json!({ "token": token })).unwrap();
    let path: PathBuf = k.dir.join(format!("{ns}.kubeconfig"));
    std::fs::write(&path, serde_yaml_ng::to_string(&kc).unwrap()).unwrap();
    let client = common::client(&path).await;
    // The RBAC authorizer reads bindings through an informer: wait until they apply.
    let lp = ListParams::default().limit(1);
    wait("publisher RBAC in effect", || async {
        Api::<Namespace>::all(client.clone())
            .list(&lp)
            .await
            .is_ok()
    })
    .await;
    client
}

async fn wait<F, Fut>(what: &str, f: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !f().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn labelled_namespace(k: &Kte, prefix: &str, labels: serde_json::Value) -> String {
    let name = unique(prefix);
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap();
    Api::<Namespace>::all(k.admin.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    name
}

async fn get_cm(k: &Kte, ns: &str) -> Option<ConfigMap> {
    Api::<ConfigMap>::namespaced(k.admin.clone(), ns)
        .get_opt(CM)
        .await
        .unwrap()
}

fn root_of(cm: &ConfigMap) -> Option<&str> {
    cm.data
        .as_ref()?
        .get(rootpub::ROOT_CERT_KEY)
        .map(String::as_str)
}

async fn wait_root(k: &Kte, ns: &str, root: &str) -> ConfigMap {
    wait(&format!("{ns}/{CM} holding the expected root"), || async {
        get_cm(k, ns)
            .await
            .is_some_and(|cm| root_of(&cm) == Some(root))
    })
    .await;
    let cm = get_cm(k, ns).await.unwrap();
    assert_eq!(
        cm.metadata.labels.as_ref().unwrap()["istio.io/config"],
        "true"
    );
    cm
}

async fn put_cm(k: &Kte, ns: &str, data: serde_json::Value) -> ConfigMap {
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": CM}, "data": data})).unwrap();
    Api::<ConfigMap>::namespaced(k.admin.clone(), ns)
        .create(&PostParams::default(), &cm)
        .await
        .unwrap()
}

#[tokio::test]
async fn publishes_to_selected_namespaces_and_follows_changes() {
    let k = kte().await;
    let client = publisher_client(&k).await;
    // A label value unique to this run, so namespaces of other tests are never selected.
    let run = unique("run");
    let on = json!({ "meshca-rootpub-test": run });
    let selected_a = labelled_namespace(&k, "rp-a", on.clone()).await;
    let selected_b = labelled_namespace(&k, "rp-b", on.clone()).await;
    let unselected = labelled_namespace(&k, "rp-c", json!({})).await;
    let later_selected =
        labelled_namespace(&k, "rp-d", json!({"meshca-rootpub-test": "other"})).await;
    // B already has a stale root and a key of someone else's; C has a ConfigMap that is not ours.
    put_cm(
        &k,
        &selected_b,
        json!({"root-cert.pem": "stale", "extra": "kept"}),
    )
    .await;
    let foreign = put_cm(&k, &unselected, json!({"root-cert.pem": "not meshca's"})).await;

    let (tx, rx) = watch::channel(ROOT_1.to_string());
    let settings = RootPublisherSettings {
        configmap_name: CM.into(),
        namespace_selector: Some(format!("meshca-rootpub-test={run}")),
        resync: Duration::from_secs(3600),
    };
    let task = tokio::spawn(rootpub::run(client, settings, rx));

    // Created where missing, updated where stale, other keys kept.
    wait_root(&k, &selected_a, ROOT_1).await;
    let b = wait_root(&k, &selected_b, ROOT_1).await;
    assert_eq!(b.data.as_ref().unwrap()["extra"], "kept");

    // The root changes (CA reload): every selected namespace follows.
    tx.send(ROOT_2.to_string()).unwrap();
    wait_root(&k, &selected_a, ROOT_2).await;
    wait_root(&k, &selected_b, ROOT_2).await;

    // A namespace created after start is picked up by the namespace watch.
    let created_later = labelled_namespace(&k, "rp-e", on.clone()).await;
    wait_root(&k, &created_later, ROOT_2).await;

    // A namespace relabelled into the selector is picked up too.
    let patch = json!({"metadata": {"labels": {"meshca-rootpub-test": run}}});
    Api::<Namespace>::all(k.admin.clone())
        .patch(
            &later_selected,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .unwrap();
    wait_root(&k, &later_selected, ROOT_2).await;

    // A deleted ConfigMap is restored (ConfigMap watch), as is an edited one.
    Api::<ConfigMap>::namespaced(k.admin.clone(), &selected_a)
        .delete(CM, &DeleteParams::default())
        .await
        .unwrap();
    wait_root(&k, &selected_a, ROOT_2).await;
    let edit = json!({"data": {"root-cert.pem": "tampered"}});
    Api::<ConfigMap>::namespaced(k.admin.clone(), &selected_b)
        .patch(CM, &PatchParams::default(), &Patch::Merge(&edit))
        .await
        .unwrap();
    wait_root(&k, &selected_b, ROOT_2).await;

    // A namespace leaving the selector keeps its last ConfigMap: never deleted, no longer updated.
    let unlabel = json!({"metadata": {"labels": {"meshca-rootpub-test": null}}});
    Api::<Namespace>::all(k.admin.clone())
        .patch(
            &created_later,
            &PatchParams::default(),
            &Patch::Merge(&unlabel),
        )
        .await
        .unwrap();
    // Namespace watch events arrive in order: once a namespace labelled after the unlabelling
    // has its ConfigMap, the publisher has seen the unlabelling too.
    let marker = labelled_namespace(&k, "rp-m", on.clone()).await;
    wait_root(&k, &marker, ROOT_2).await;
    tx.send(ROOT_3.to_string()).unwrap();
    wait_root(&k, &selected_a, ROOT_3).await;
    wait_root(&k, &selected_b, ROOT_3).await;
    wait_root(&k, &later_selected, ROOT_3).await;
    let left = get_cm(&k, &created_later).await.expect("kept, not deleted");
    assert_eq!(root_of(&left), Some(ROOT_2));

    // The unselected namespace's ConfigMap was never written, and none was created in it.
    let after = get_cm(&k, &unselected).await.unwrap();
    assert_eq!(
        after.metadata.resource_version,
        foreign.metadata.resource_version
    );
    assert_eq!(root_of(&after), Some("not meshca's"));

    assert!(!task.is_finished(), "publisher stopped: {task:?}");
    task.abort();
}

#[tokio::test]
async fn skips_terminating_namespaces_and_keeps_going() {
    let k = kte().await;
    let client = publisher_client(&k).await;
    let run = unique("run");
    let on = json!({ "meshca-rootpub-test": run });
    let doomed = labelled_namespace(&k, "rp-t", on.clone()).await;
    let (_tx, rx) = watch::channel(ROOT_1.to_string());
    let settings = RootPublisherSettings {
        configmap_name: CM.into(),
        namespace_selector: Some(format!("meshca-rootpub-test={run}")),
        resync: Duration::from_secs(1),
    };
    let task = tokio::spawn(rootpub::run(client, settings, rx));
    wait_root(&k, &doomed, ROOT_1).await;

    // No namespace controller runs here, so a deleted namespace stays Terminating for good.
    Api::<Namespace>::all(k.admin.clone())
        .delete(&doomed, &DeleteParams::default())
        .await
        .unwrap();
    wait("namespace terminating", || async {
        Api::<Namespace>::all(k.admin.clone())
            .get(&doomed)
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_some()
    })
    .await;
    let fresh = labelled_namespace(&k, "rp-f", on).await;
    wait_root(&k, &fresh, ROOT_1).await;
    let delete_cm = |ns: String| {
        let api = Api::<ConfigMap>::namespaced(k.admin.clone(), &ns);
        async move { api.delete(CM, &DeleteParams::default()).await.unwrap() }
    };
    delete_cm(doomed.clone()).await;
    delete_cm(fresh.clone()).await;
    // ConfigMap watch events arrive in order: when the second deletion has been repaired, the
    // first has been handled, and in the terminating namespace that means left alone.
    wait_root(&k, &fresh, ROOT_1).await;
    // Two resync periods (1 s) pass without a write there either.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(get_cm(&k, &doomed).await.is_none());
    assert!(!task.is_finished(), "publisher stopped: {task:?}");
    task.abort();
}

#[tokio::test]
async fn rbac_fixture_grants_no_general_configmap_access() {
    // The least-privilege claim behind the chart's rules: the publisher identity can list its
    // own ConfigMaps by name, but cannot read other ConfigMaps.
    let k = kte().await;
    let client = publisher_client(&k).await;
    let ns = labelled_namespace(&k, "rp-p", json!({})).await;
    let other: ConfigMap = serde_json::from_value(
        json!({"metadata": {"name": "app-settings"}, "data": {"password": "x"}}),
    )
    .unwrap();
    Api::<ConfigMap>::namespaced(k.admin.clone(), &ns)
        .create(&PostParams::default(), &other)
        .await
        .unwrap();
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    let err = api.get("app-settings").await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.is_forbidden()),
        "{err:?}"
    );
    let all = Api::<ConfigMap>::all(client.clone());
    let err = all.list(&ListParams::default()).await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.is_forbidden()),
        "{err:?}"
    );
    let by_name = ListParams::default().fields(&format!("metadata.name={CM}"));
    let listed = all.list(&by_name).await.unwrap();
    assert!(listed
        .items
        .iter()
        .all(|c| c.metadata.name.as_deref() == Some(CM)));
}
