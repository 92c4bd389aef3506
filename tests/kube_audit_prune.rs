//! The audit prune CronJob's rights in the real kube-apiserver. RBAC can
//! only grant it list and delete on every ConfigMap of the namespace; the
//! chart's ValidatingAdmissionPolicy (tests/fixtures/vap-audit-prune.yaml,
//! which tests/chart.rs checks the chart renders) keeps the delete to the
//! audit anchors: the prune ServiceAccount can remove an anchor, but not the
//! revocations ConfigMap, nor anything not named and labelled as an anchor.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::Api;
use serde_json::json;

const SA: &str = "meshca-audit-prune";
const SET: &str = "meshca-audit-anchors";
const POLICY: &str = "tests/fixtures/vap-audit-prune.yaml";

/// The chart's prune Role (list and delete ConfigMaps), bound to `ns/SA`.
async fn prune_rbac(k: &common::Kte, ns: &str) {
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": SA},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list", "delete"]}]
    }))
    .unwrap();
    Api::<Role>::namespaced(k.admin.clone(), ns)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let rb: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": SA},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SA},
        "subjects": [{"kind": "ServiceAccount", "name": SA, "namespace": ns}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(k.admin.clone(), ns)
        .create(&PostParams::default(), &rb)
        .await
        .unwrap();
}

/// The fixture policy and binding, for `ns` instead of istio-system.
async fn apply_policy(k: &common::Kte, ns: &str) {
    let text =
        std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(POLICY))
            .unwrap()
            .replace("istio-system", ns);
    let mut docs = text.split("\n---\n");
    let policy: ValidatingAdmissionPolicy = serde_yaml_ng::from_str(docs.next().unwrap()).unwrap();
    let binding: ValidatingAdmissionPolicyBinding =
        serde_yaml_ng::from_str(docs.next().unwrap()).unwrap();
    Api::<ValidatingAdmissionPolicy>::all(k.admin.clone())
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    Api::<ValidatingAdmissionPolicyBinding>::all(k.admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
}

/// A client authenticated as `ns/SA` (a TokenRequest token).
async fn prune_client(k: &common::Kte, ns: &str) -> kube::Client {
    let env = std::fs::read_to_string(k.dir.join("env")).unwrap();
    let var = |name: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("export {name}=")))
            .unwrap()
            .trim_matches(|c| c == '\'' || c == '"')
            .to_string()
    };
    let token = k.token(ns, SA, None, &k.issuer).await;
    let path = k.dir.join(format!("prune-{ns}.kubeconfig"));
    std::fs::write(
        &path,
        serde_json::to_string(&json!({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": var("KTE_API_URL"), "certificate-authority": var("KTE_CA_CERT")}}],
            "users": [{"name": "u", "user": {"token": token}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]
        }))
        .unwrap(),
    )
    .unwrap();
    common::client(&path).await
}

async fn configmap(k: &common::Kte, ns: &str, name: &str, anchor_label: bool) {
    let mut cm = json!({"metadata": {"name": name}, "data": {"x": "y"}});
    if anchor_label {
        cm["metadata"]["labels"] = json!({
            "audit.meshca.io/anchor-set": SET,
            "audit.meshca.io/kind": "checkpoint"
        });
    }
    Api::<ConfigMap>::namespaced(k.admin.clone(), ns)
        .create(&PostParams::default(), &serde_json::from_value(cm).unwrap())
        .await
        .unwrap();
}

async fn delete(c: &kube::Client, ns: &str, name: &str) -> Result<(), String> {
    match Api::<ConfigMap>::namespaced(c.clone(), ns)
        .delete(name, &DeleteParams::default())
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) => Err(format!("{} {}", s.code, s.message)),
        Err(e) => panic!("delete {name}: {e}"),
    }
}

#[tokio::test]
async fn the_prune_service_account_deletes_only_anchors() {
    let k = common::kte().await;
    let ns = k.namespace("audit-prune").await;
    k.service_account(&ns, SA).await;
    prune_rbac(&k, &ns).await;
    let pruner = prune_client(&k, &ns).await;
    // Without the policy, RBAC alone lets it delete any ConfigMap: the
    // reason the chart ships the policy.
    configmap(&k, &ns, "meshca-revocations", false).await;
    for _ in 0..50 {
        // (RBAC for a new binding can take a moment to be seen.)
        if delete(&pruner, &ns, "meshca-revocations").await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        Api::<ConfigMap>::namespaced(k.admin.clone(), &ns)
            .get_opt("meshca-revocations")
            .await
            .unwrap()
            .is_none(),
        "RBAC alone: the prune ServiceAccount removed the revocations"
    );

    apply_policy(&k, &ns).await;
    // The policy takes effect asynchronously: wait until a non-anchor
    // delete is refused (each try uses a fresh object).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut n = 0;
    let refusal = loop {
        n += 1;
        let name = format!("canary-{n}");
        configmap(&k, &ns, &name, false).await;
        if let Err(e) = delete(&pruner, &ns, &name).await {
            break e;
        }
        assert!(Instant::now() < deadline, "the policy never took effect");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        refusal.contains("may delete only audit anchors"),
        "{refusal}"
    );

    configmap(&k, &ns, "meshca-revocations", false).await;
    configmap(&k, &ns, &format!("{SET}.meshca-0.abcd.7"), true).await;
    configmap(&k, &ns, &format!("{SET}.unlabelled"), false).await;
    configmap(&k, &ns, "istio-labelled-like-an-anchor", true).await;
    // list is what prune starts with.
    let listed = Api::<ConfigMap>::namespaced(pruner.clone(), &ns)
        .list(&ListParams::default().labels(&format!("audit.meshca.io/anchor-set={SET}")))
        .await
        .unwrap();
    assert_eq!(listed.items.len(), 2);
    assert_eq!(
        delete(&pruner, &ns, &format!("{SET}.meshca-0.abcd.7")).await,
        Ok(()),
        "an anchor is removed"
    );
    for name in [
        "meshca-revocations",
        &format!("{SET}.unlabelled"),
        "istio-labelled-like-an-anchor",
    ] {
        let e = delete(&pruner, &ns, name).await.unwrap_err();
        assert!(e.contains("may delete only audit anchors"), "{name}: {e}");
    }
    // The policy matches only the prune ServiceAccount: the admin still can.
    assert_eq!(delete(&k.admin, &ns, "meshca-revocations").await, Ok(()));
    Api::<ValidatingAdmissionPolicyBinding>::all(k.admin.clone())
        .delete(&format!("{SA}.{ns}.meshca.io"), &DeleteParams::default())
        .await
        .unwrap();
    Api::<ValidatingAdmissionPolicy>::all(k.admin.clone())
        .delete(&format!("{SA}.{ns}.meshca.io"), &DeleteParams::default())
        .await
        .unwrap();
}
