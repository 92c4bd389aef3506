//! The Helm chart as rendered by the real helm binary (built from Go modules
//! by scripts/chart-test into $MESHCA_CACHE/bin/helm): its RBAC is exactly the
//! RBAC the Kubernetes integration tests run with, ci-values.yaml sets every
//! value, and the pod runs with the restricted security settings.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_yaml_ng::Value;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// helm from $MESHCA_HELM, else the cache scripts/chart-test builds into.
fn helm() -> PathBuf {
    let path = std::env::var_os("MESHCA_HELM")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("MESHCA_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/meshca")
                });
            cache.join("bin/helm")
        });
    assert!(
        path.is_file(),
        "{} not found: these tests need helm. Run ./scripts/test, or scripts/chart-test KTE_DIR (builds it), or set MESHCA_HELM",
        path.display()
    );
    path
}

/// `helm template` of one template with extra flags; the YAML documents.
fn render(template: &str, release: &str, namespace: &str, flags: &[&str]) -> Vec<Value> {
    let mut all = vec!["--show-only", template];
    all.extend_from_slice(flags);
    helm_template(release, namespace, &all)
}

/// `helm template` of the chart as `release` in `namespace` with `flags`;
/// the YAML documents.
fn helm_template(release: &str, namespace: &str, flags: &[&str]) -> Vec<Value> {
    let out = Command::new(helm())
        .args(["template", release])
        .arg(repo().join("charts/meshca"))
        .args(["--namespace", namespace])
        .args(flags)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helm template {flags:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    docs(&String::from_utf8(out.stdout).unwrap())
}

fn docs(yaml: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// A policy rule with its lists as sets, so order inside a rule does not matter.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Rule {
    api_groups: BTreeSet<String>,
    resources: BTreeSet<String>,
    resource_names: BTreeSet<String>,
    verbs: BTreeSet<String>,
}

fn set(v: &Value, key: &str) -> BTreeSet<String> {
    v.get(key)
        .and_then(Value::as_sequence)
        .map(|s| s.iter().map(|x| x.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// The rules of every ClusterRole in `docs`, sorted (a multiset).
fn rules(docs: &[Value]) -> Vec<Rule> {
    rules_of(docs, "ClusterRole")
}

/// The rules of every object of `kind` (ClusterRole or Role) in `docs`, sorted.
fn rules_of(docs: &[Value], kind: &str) -> Vec<Rule> {
    let mut out: Vec<Rule> = docs
        .iter()
        .filter(|d| d["kind"].as_str() == Some(kind))
        .flat_map(|d| d["rules"].as_sequence().cloned().unwrap_or_default())
        .map(|r| Rule {
            api_groups: set(&r, "apiGroups"),
            resources: set(&r, "resources"),
            resource_names: set(&r, "resourceNames"),
            verbs: set(&r, "verbs"),
        })
        .collect();
    out.sort();
    out
}

fn fixture_rules(rel: &str) -> Vec<Rule> {
    rules(&docs(&std::fs::read_to_string(repo().join(rel)).unwrap()))
}

fn fixture_rules_of(rel: &str, kind: &str) -> Vec<Rule> {
    rules_of(
        &docs(&std::fs::read_to_string(repo().join(rel)).unwrap()),
        kind,
    )
}

fn chart_rules(flags: &[&str]) -> Vec<Rule> {
    let r = rules(&render(
        "templates/clusterrole.yaml",
        "meshca",
        "istio-system",
        flags,
    ));
    assert!(!r.is_empty(), "no ClusterRole rendered for {flags:?}");
    r
}

const TESTENV_RBAC: &str = "scripts/kube-testenv.d/meshca-rbac.yaml";
const PUBLISHER_RBAC: &str = "tests/fixtures/rbac-root-publisher.yaml";

#[test]
fn default_cluster_role_is_exactly_the_test_cluster_rbac() {
    // Root publishing is off by default; trusted node accounts are set (istio-system/ztunnel).
    let expected = fixture_rules(TESTENV_RBAC);
    assert_eq!(expected.len(), 3, "fixture changed shape: {expected:?}");
    assert_eq!(chart_rules(&[]), expected);
}

#[test]
fn root_publishing_adds_exactly_the_publisher_rules() {
    let mut expected = fixture_rules(TESTENV_RBAC);
    let publisher = fixture_rules(PUBLISHER_RBAC);
    assert!(
        publisher
            .iter()
            .any(|r| r.resources.contains("configmaps") && !r.resource_names.is_empty()),
        "publisher fixture lost its resourceNames restriction"
    );
    expected.extend(publisher);
    expected.sort();
    assert_eq!(
        chart_rules(&["--set", "rootPublisher.enabled=true"]),
        expected
    );
}

#[test]
fn publisher_rules_follow_the_configmap_name() {
    let got = chart_rules(&[
        "--set",
        "rootPublisher.enabled=true",
        "--set",
        "rootPublisher.configMapName=mesh-roots",
    ]);
    let named: Vec<&Rule> = got
        .iter()
        .filter(|r| !r.resource_names.is_empty())
        .collect();
    assert_eq!(named.len(), 1, "{got:?}");
    assert_eq!(
        named[0].resource_names,
        BTreeSet::from(["mesh-roots".to_string()])
    );
    // ConfigMaps are never readable without the name restriction.
    assert!(got.iter().all(|r| !r.resources.contains("configmaps")
        || !r.resource_names.is_empty()
        || r.verbs == BTreeSet::from(["create".to_string()])));
}

#[test]
fn no_trusted_node_accounts_no_renewal_pod_check_and_review_only_means_no_pod_access() {
    let got = chart_rules(&[
        "--set-json",
        "trustedNodeAccounts=[]",
        "--set",
        "killSwitch.renewalPodCheck=false",
        "--set",
        "tokenVerification.mode=review",
    ]);
    let expected: Vec<Rule> = fixture_rules(TESTENV_RBAC)
        .into_iter()
        .filter(|r| !r.resources.contains("pods") && !r.resources.contains("serviceaccounts"))
        .collect();
    assert_eq!(got, expected);
    // Local token verification needs the pod and ServiceAccount indexes even
    // without impersonation.
    let got = chart_rules(&[
        "--set-json",
        "trustedNodeAccounts=[]",
        "--set",
        "killSwitch.renewalPodCheck=false",
        "--set",
        "tokenVerification.mode=local",
    ]);
    assert_eq!(got, fixture_rules(TESTENV_RBAC));
}

/// The ClusterRole names the ClusterRoleBindings in `docs` grant.
/// Names of the namespaced Roles among `docs`.
fn role_names(docs: &[Value]) -> BTreeSet<String> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some("Role"))
        .map(|d| d["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

fn bound_roles(docs: &[Value]) -> BTreeSet<String> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some("ClusterRoleBinding"))
        .map(|d| d["roleRef"]["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn issuer_discovery_is_bound_in_every_mode_like_the_test_cluster() {
    let discovery = "system:service-account-issuer-discovery".to_string();
    let testenv = docs(&std::fs::read_to_string(repo().join(TESTENV_RBAC)).unwrap());
    assert!(bound_roles(&testenv).contains(&discovery));
    let render_binding = |mode: &str| {
        bound_roles(&render(
            "templates/clusterrolebinding.yaml",
            "meshca",
            "istio-system",
            &["--set", &format!("tokenVerification.mode={mode}")],
        ))
    };
    // In every mode: `token-key` denylist entries need the issuer keys too.
    for mode in ["review", "local", "local-then-review"] {
        let got = render_binding(mode);
        assert_eq!(
            got,
            BTreeSet::from(["meshca".to_string(), discovery.clone()])
        );
    }
}

const DENYLIST_RBAC: &str = "tests/fixtures/rbac-denylist.yaml";
const CRL_PUBLISHER_RBAC: &str = "tests/fixtures/rbac-crl-publisher.yaml";

#[test]
fn renewal_pod_check_alone_keeps_exactly_the_pod_and_service_account_rules() {
    // Bounded mTLS renewal reads the pod index even with no trusted node account.
    let got = chart_rules(&[
        "--set-json",
        "trustedNodeAccounts=[]",
        "--set",
        "tokenVerification.mode=review",
    ]);
    // The ServiceAccount index runs beside the pod index: cached TokenReview
    // successes are checked against both.
    assert_eq!(got, fixture_rules(TESTENV_RBAC));
}

#[test]
fn crl_publishing_adds_exactly_the_crl_publisher_rules() {
    let mut expected = fixture_rules(TESTENV_RBAC);
    expected.extend(fixture_rules(CRL_PUBLISHER_RBAC));
    expected.sort();
    let crl = [
        "--set",
        "killSwitch.revocation.enabled=true",
        "--set",
        "killSwitch.revocation.publish=true",
    ];
    assert_eq!(chart_rules(&crl), expected);
    // Revocation without publishing needs no Kubernetes access at all.
    assert_eq!(
        chart_rules(&["--set", "killSwitch.revocation.enabled=true"]),
        fixture_rules(TESTENV_RBAC)
    );
    // With root publishing on too, only the istio-ca-crl name is added.
    let mut both = crl.to_vec();
    both.extend(["--set", "rootPublisher.enabled=true"]);
    let mut expected = fixture_rules(TESTENV_RBAC);
    expected.extend(fixture_rules(PUBLISHER_RBAC));
    expected.extend(
        fixture_rules(CRL_PUBLISHER_RBAC)
            .into_iter()
            .filter(|r| !r.resource_names.is_empty()),
    );
    expected.sort();
    assert_eq!(chart_rules(&both), expected);
}

#[test]
fn denylist_role_is_exactly_the_fixture_and_namespaced() {
    let docs = render("templates/role.yaml", "meshca", "istio-system", &[]);
    assert_eq!(
        rules_of(&docs, "Role"),
        rules_of(
            &self::docs(&std::fs::read_to_string(repo().join(DENYLIST_RBAC)).unwrap()),
            "Role"
        )
    );
    let binding = docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("RoleBinding"))
        .expect("RoleBinding");
    assert_eq!(
        binding["subjects"][0]["namespace"].as_str(),
        Some("istio-system")
    );
    // The env names the same ConfigMap in the release namespace.
    let d = render("templates/deployment.yaml", "meshca", "istio-system", &[]);
    assert!(env_of(&d[0]).contains(&(
        "MESHCA_DENYLIST_CONFIGMAP".into(),
        "istio-system/meshca-denylist".into()
    )));
    // No name: no Role.
    let out = Command::new(helm())
        .args(["template", "meshca"])
        .arg(repo().join("charts/meshca"))
        .args(["--set", "killSwitch.denylist.configMapName="])
        .output()
        .unwrap();
    assert!(out.status.success());
    // (The audit anchor's own Role stays; tested with the audit chart.)
    let roles = role_names(&self::docs(&String::from_utf8_lossy(&out.stdout)));
    assert!(!roles.contains("meshca-denylist"), "{roles:?}");
    assert!(roles.contains("meshca-audit-anchor"), "{roles:?}");
}

#[test]
fn revocation_mounts_a_writable_state_volume() {
    let d = render(
        "templates/deployment.yaml",
        "meshca",
        "istio-system",
        &[
            "--set",
            "killSwitch.revocation.enabled=true",
            "--set",
            "killSwitch.revocation.existingClaim=meshca-state",
        ],
    );
    let pod = &d[0]["spec"]["template"]["spec"];
    let mount = pod["containers"][0]["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["name"].as_str() == Some("state"))
        .expect("state mount");
    assert_eq!(mount["mountPath"].as_str(), Some("/var/lib/meshca"));
    assert!(mount.get("readOnly").is_none());
    let vol = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"].as_str() == Some("state"))
        .expect("state volume");
    assert_eq!(
        vol["persistentVolumeClaim"]["claimName"].as_str(),
        Some("meshca-state")
    );
    let env = env_of(&d[0]);
    // Revocations are shared by every replica: the ConfigMap, never a per-pod file.
    assert!(env.contains(&(
        "MESHCA_REVOCATION_CONFIGMAP".into(),
        "istio-system/meshca-revocations".into()
    )));
    assert!(!env.iter().any(|(k, _)| k == "MESHCA_REVOCATION_FILE"));
    assert!(env.contains(&(
        "MESHCA_DENYLIST_FILE".into(),
        "/var/lib/meshca/denylist".into()
    )));
}

const REVOCATIONS_RBAC: &str = "tests/fixtures/rbac-revocations.yaml";

#[test]
fn revocations_role_is_exactly_the_fixture_read_only_and_namespaced() {
    let on = ["--set", "killSwitch.revocation.enabled=true"];
    let docs = render("templates/role.yaml", "meshca", "istio-system", &on);
    let role = docs
        .iter()
        .find(|d| {
            d["kind"].as_str() == Some("Role")
                && d["metadata"]["name"].as_str() == Some("meshca-revocations")
        })
        .expect("revocations Role");
    assert_eq!(
        rules_of(std::slice::from_ref(role), "Role"),
        rules_of(
            &self::docs(&std::fs::read_to_string(repo().join(REVOCATIONS_RBAC)).unwrap()),
            "Role"
        )
    );
    let binding = docs
        .iter()
        .find(|d| {
            d["kind"].as_str() == Some("RoleBinding")
                && d["metadata"]["name"].as_str() == Some("meshca-revocations")
        })
        .expect("RoleBinding");
    assert_eq!(
        binding["roleRef"]["name"].as_str(),
        Some("meshca-revocations")
    );
    assert_eq!(
        binding["subjects"][0]["namespace"].as_str(),
        Some("istio-system")
    );
    // Across the whole chart (every Role and ClusterRole, the audit
    // anchor's included), no rule that reaches the store's name (by name,
    // or on every ConfigMap) grants more than reading it or creating new
    // objects: nothing rewrites, empties or deletes it.
    for (what, flags, name) in [
        (
            "revocation, publishing and anchors on",
            vec![
                "--set",
                "killSwitch.revocation.enabled=true",
                "--set",
                "killSwitch.revocation.publish=true",
                "--set",
                "rootPublisher.enabled=true",
                "--set",
                "audit.anchor.enabled=true",
            ],
            "meshca-revocations",
        ),
        (
            "ci-values.yaml",
            vec!["-f", "ci-values.yaml"],
            "meshca-revoked",
        ),
    ] {
        let ci = repo()
            .join("charts/meshca/ci-values.yaml")
            .display()
            .to_string();
        let flags: Vec<&str> = flags
            .into_iter()
            .map(|f| {
                if f == "ci-values.yaml" {
                    ci.as_str()
                } else {
                    f
                }
            })
            .collect();
        let all = render_all(&flags);
        // The prune CronJob's Role may delete ConfigMaps; its admission
        // policy keeps that to the anchors (checked in
        // anchor_prune_is_a_cronjob_with_only_what_prune_needs and, in the
        // API server, tests/kube_audit_prune.rs).
        let has_prune = role_names(&all).iter().any(|n| n.ends_with("-audit-prune"));
        assert_eq!(
            has_prune,
            of_kind(&all, "ValidatingAdmissionPolicy")
                .iter()
                .any(|d| d["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.contains("-audit-prune."))),
            "{what}: the prune Role comes with its policy"
        );
        let all: Vec<Value> = all
            .into_iter()
            .filter(|d| {
                !(d["kind"].as_str() == Some("Role")
                    && d["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| n.ends_with("-audit-prune")))
            })
            .collect();
        let mut rules = rules_of(&all, "Role");
        rules.extend(rules_of(&all, "ClusterRole"));
        assert!(
            rules.iter().any(|r| r.resource_names.contains(name)),
            "{what}: no rule names {name}"
        );
        for r in rules {
            let any = |s: &BTreeSet<String>, v: &str| s.contains(v) || s.contains("*");
            let reaches = any(&r.api_groups, "")
                && any(&r.resources, "configmaps")
                && (r.resource_names.is_empty() || r.resource_names.contains(name));
            if reaches {
                assert!(
                    r.verbs
                        .iter()
                        .all(|v| ["get", "list", "watch", "create"].contains(&v.as_str())),
                    "{what}: {r:?} reaches {name}"
                );
            }
        }
    }
    // Off: no Role.
    let off = render("templates/role.yaml", "meshca", "istio-system", &[]);
    assert!(!role_names(&off).contains("meshca-revocations"));
}

/// Leaf paths of a values tree; lists and empty maps are leaves.
fn leaf_paths(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match v.as_mapping() {
        Some(m) if !m.is_empty() => {
            for (k, child) in m {
                let key = k.as_str().unwrap();
                let path = if prefix.is_empty() {
                    key.to_string()
                } else {
                    format!("{prefix}.{key}")
                };
                leaf_paths(child, &path, out);
            }
        }
        _ => {
            out.insert(prefix.to_string());
        }
    }
}

#[test]
fn ci_values_set_every_value() {
    let load = |f: &str| -> Value {
        serde_yaml_ng::from_str(
            &std::fs::read_to_string(repo().join("charts/meshca").join(f)).unwrap(),
        )
        .unwrap()
    };
    let (mut defaults, mut ci) = (BTreeSet::new(), BTreeSet::new());
    leaf_paths(&load("values.yaml"), "", &mut defaults);
    leaf_paths(&load("ci-values.yaml"), "", &mut ci);
    assert!(defaults.len() > 40, "{defaults:?}");
    // Kubernetes objects passed through as-is: compare their presence, not their shape.
    let free_form = |s: BTreeSet<String>| -> BTreeSet<String> {
        s.into_iter()
            .map(|p| match p.split_once('.') {
                Some((top @ ("resources" | "affinity"), _)) => top.to_string(),
                _ => p,
            })
            .collect()
    };
    let (defaults, ci) = (free_form(defaults), free_form(ci));
    // A default that is an empty map or a list is free-form too: any content under it counts.
    let covers =
        |leaf: &String, path: &String| path == leaf || path.starts_with(&format!("{leaf}."));
    let missing: Vec<_> = defaults
        .iter()
        .filter(|d| !ci.iter().any(|c| covers(d, c)))
        .collect();
    assert!(
        missing.is_empty(),
        "ci-values.yaml does not set {missing:?}"
    );
    let unknown: Vec<_> = ci
        .iter()
        .filter(|c| !defaults.iter().any(|d| covers(d, c)))
        .collect();
    assert!(
        unknown.is_empty(),
        "ci-values.yaml sets keys values.yaml lacks: {unknown:?}"
    );
}

fn env_of(deployment: &Value) -> Vec<(String, String)> {
    deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|e| Some((e["name"].as_str()?.into(), e["value"].as_str()?.into())))
        .collect()
}

#[test]
fn default_serving_names_are_the_service_dns_names() {
    let d = render("templates/deployment.yaml", "mesh", "ca-system", &[]);
    let env = env_of(&d[0]);
    let names = env
        .iter()
        .find(|(k, _)| k == "MESHCA_SERVING_NAMES")
        .map(|(_, v)| v.as_str())
        .unwrap();
    assert_eq!(
        names,
        "mesh-meshca.ca-system.svc,mesh-meshca.ca-system.svc.cluster.local"
    );
    let svc = render("templates/service.yaml", "mesh", "ca-system", &[]);
    assert_eq!(svc[0]["metadata"]["name"].as_str(), Some("mesh-meshca"));
}

#[test]
fn pod_is_restricted_and_mounts_cacerts_for_hot_reload() {
    let d = render("templates/deployment.yaml", "meshca", "istio-system", &[]);
    let pod = &d[0]["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let sc = &c["securityContext"];
    assert_eq!(sc["runAsNonRoot"].as_bool(), Some(true));
    assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(sc["allowPrivilegeEscalation"].as_bool(), Some(false));
    assert_eq!(sc["capabilities"]["drop"][0].as_str(), Some("ALL"));
    assert_eq!(
        sc["seccompProfile"]["type"].as_str(),
        Some("RuntimeDefault")
    );
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    assert_eq!(c["command"][0].as_str(), Some("/usr/local/bin/meshca"));
    assert_eq!(c["args"][0].as_str(), Some("serve"));
    assert_eq!(
        c["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert_eq!(
        c["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz")
    );
    let mount = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"].as_str() == Some("/etc/cacerts"))
        .expect("cacerts mount");
    // A subPath mount would never see the kubelet's Secret updates.
    assert!(mount.get("subPath").is_none() && mount.get("subPathExpr").is_none());
    let env = env_of(&d[0]);
    assert!(env.contains(&("ROOT_CA_DIR".into(), "/etc/cacerts".into())));
    let labels = &d[0]["spec"]["template"]["metadata"]["labels"];
    assert_eq!(labels["sidecar.istio.io/inject"].as_str(), Some("false"));
    assert_eq!(labels["istio.io/dataplane-mode"].as_str(), Some("none"));
    // Audit file sink: a writable volume appears, one directory per pod on a shared claim.
    let d = render(
        "templates/deployment.yaml",
        "meshca",
        "istio-system",
        &[
            "--set",
            "audit.sink=file",
            "--set",
            "audit.file.existingClaim=audit",
        ],
    );
    let c = &d[0]["spec"]["template"]["spec"]["containers"][0];
    let audit = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["name"].as_str() == Some("audit"))
        .expect("audit mount");
    assert_eq!(audit["mountPath"].as_str(), Some("/var/log/meshca"));
    assert_eq!(audit["subPathExpr"].as_str(), Some("$(POD_NAME)"));
}

/// The revocation store exists from install on, so no one who can create
/// ConfigMaps in the namespace (meshca's own pod included: the anchor Role
/// grants create on every ConfigMap there) can plant it first. It is empty
/// and renders no data, so an upgrade never rewrites what `meshca revoke`
/// wrote, and uninstall keeps it; meshca itself still only reads it.
#[test]
fn the_revocation_store_is_created_empty_at_install() {
    let store_maps = |flags: &[&str]| -> Vec<Value> {
        render_all(flags)
            .into_iter()
            .filter(|d| {
                d["kind"].as_str() == Some("ConfigMap")
                    && d["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| n.contains("revo"))
            })
            .collect()
    };
    let on = ["--set", "killSwitch.revocation.enabled=true"];
    let maps = store_maps(&on);
    assert_eq!(maps.len(), 1, "{maps:?}");
    let cm = &maps[0];
    // The very object the server reads.
    let dep = render("templates/deployment.yaml", "meshca", "istio-system", &on);
    let (ns, name) = env_of(&dep[0])
        .into_iter()
        .find(|(k, _)| k == "MESHCA_REVOCATION_CONFIGMAP")
        .map(|(_, v)| {
            let (ns, n) = v.split_once('/').unwrap();
            (ns.to_string(), n.to_string())
        })
        .unwrap();
    assert_eq!(cm["metadata"]["name"].as_str(), Some(name.as_str()));
    assert_eq!(cm["metadata"]["namespace"].as_str(), Some(ns.as_str()));
    assert!(
        cm.get("data").is_none(),
        "no data to rewrite on upgrade: {cm:?}"
    );
    assert!(cm.get("binaryData").is_none());
    assert!(
        cm.get("immutable").is_none(),
        "meshca revoke must be able to append"
    );
    assert_eq!(
        cm["metadata"]["annotations"]["helm.sh/resource-policy"].as_str(),
        Some("keep"),
        "uninstall keeps the revocations"
    );
    // ci-values.yaml names another store: the same, under that name.
    let ci = repo()
        .join("charts/meshca/ci-values.yaml")
        .display()
        .to_string();
    let maps = store_maps(&["-f", &ci]);
    assert_eq!(maps.len(), 1);
    assert_eq!(maps[0]["metadata"]["name"].as_str(), Some("meshca-revoked"));
    // Revocation off, or the operator keeps a store Helm does not own: none.
    assert!(store_maps(&[]).is_empty());
    assert!(store_maps(&[
        "--set",
        "killSwitch.revocation.enabled=true",
        "--set",
        "killSwitch.revocation.createConfigMap=false"
    ])
    .is_empty());
    // meshca still only reads it: no create, update or delete on its name.
    let docs = render("templates/role.yaml", "meshca", "istio-system", &on);
    let rules: Vec<Rule> = rules_of(&docs, "Role")
        .into_iter()
        .filter(|r| r.resource_names.contains("meshca-revocations"))
        .collect();
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0].verbs, ["get"].map(String::from).into());
}

const AUDIT_ANCHOR_RBAC: &str = "tests/fixtures/rbac-audit-anchor.yaml";

const AUDIT_KEY_RBAC: &str = "tests/fixtures/rbac-audit-checkpoint-key.yaml";

/// Signed checkpoints and anchors are on by default. The checkpoint key is
/// made in the cluster by meshca itself (MESHCA_AUDIT_CHECKPOINT_KEY_SECRET),
/// never in the render: no Secret is rendered, and meshca gets exactly the
/// Role tests/kube_audit_key.rs runs it with (get on that Secret, create on
/// Secrets). The anchor Role is the fixture tests/audit_anchor.rs runs meshca
/// with (create and read ConfigMaps, create Events) in the release namespace.
#[test]
fn audit_checkpoints_are_signed_and_anchored_by_default() {
    let all = render_all(&[]);
    assert!(
        of_kind(&all, "Secret").is_empty(),
        "the chart renders no Secret (no key made by a render)"
    );
    let key_role = render(
        "templates/audit-checkpoint-key.yaml",
        "meshca",
        "istio-system",
        &[],
    );
    assert_eq!(
        rules_of(&key_role, "Role"),
        fixture_rules_of(AUDIT_KEY_RBAC, "Role"),
        "exactly the rules tests/kube_audit_key.rs runs meshca with"
    );
    assert_eq!(
        key_role[1]["subjects"][0]["name"].as_str(),
        Some("meshca"),
        "bound to meshca's ServiceAccount"
    );
    // The admission policy that keeps meshca's create to that Secret is
    // exactly the one tests/kube_audit_key.rs checks in the API server.
    let policy: Vec<Value> = key_role
        .iter()
        .filter(|d| {
            d["kind"]
                .as_str()
                .is_some_and(|k| k.starts_with("ValidatingAdmissionPolicy"))
        })
        .map(|d| {
            let mut d = d.clone();
            d["metadata"].as_mapping_mut().unwrap().remove("labels");
            d
        })
        .collect();
    assert_eq!(
        policy,
        docs(
            &std::fs::read_to_string(repo().join("tests/fixtures/vap-audit-checkpoint-key.yaml"))
                .unwrap()
        )
    );
    let env = env_of(&of_kind(&all, "Deployment")[0].clone());
    assert!(env.contains(&(
        "MESHCA_AUDIT_CHECKPOINT_KEY_SECRET".into(),
        "istio-system/meshca-audit-checkpoint-key".into()
    )));
    // The Secret's name follows the release; get stays limited to it.
    let other = render("templates/audit-checkpoint-key.yaml", "r", "ns1", &[]);
    assert_eq!(
        other[0]["rules"][0]["resourceNames"][0].as_str(),
        Some("r-meshca-audit-checkpoint-key")
    );
    // A given Secret is mounted instead, and meshca gets no Secret rights.
    let given = ["--set", "audit.checkpoint.secretName=mine"];
    assert!(render_all(&given).iter().all(|d| !d["metadata"]["name"]
        .as_str()
        .unwrap_or("")
        .ends_with("-audit-checkpoint-key")));
    let env = env_of(&render("templates/deployment.yaml", "r", "ns1", &given)[0]);
    assert!(env.contains(&(
        "MESHCA_AUDIT_CHECKPOINT_KEY".into(),
        "/etc/meshca/audit-checkpoint-key/key.pem".into()
    )));
    assert!(!env
        .iter()
        .any(|(k, _)| k == "MESHCA_AUDIT_CHECKPOINT_KEY_SECRET"));

    let anchor = render("templates/audit-anchor.yaml", "r", "ns1", &[]);
    let kinds: Vec<&str> = anchor.iter().filter_map(|d| d["kind"].as_str()).collect();
    // No anchor ConfigMap: each anchor is its own object, created by meshca.
    assert_eq!(kinds, ["Role", "RoleBinding"]);
    assert_eq!(
        rules_of(&anchor, "Role"),
        rules_of(
            &docs(&std::fs::read_to_string(repo().join(AUDIT_ANCHOR_RBAC)).unwrap()),
            "Role"
        ),
        "exactly the rules tests/audit_anchor.rs runs meshca with"
    );
    assert_eq!(anchor[1]["subjects"][0]["namespace"].as_str(), Some("ns1"));

    let dep = render("templates/deployment.yaml", "r", "ns1", &[]);
    let env = env_of(&dep[0]);
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(
        get("MESHCA_AUDIT_CHECKPOINT_KEY_SECRET").as_deref(),
        Some("ns1/r-meshca-audit-checkpoint-key")
    );
    assert_eq!(get("MESHCA_AUDIT_CHECKPOINT_KEY"), None);
    assert_eq!(get("MESHCA_AUDIT_ANCHOR").as_deref(), Some("true"));
    assert_eq!(get("MESHCA_AUDIT_ANCHOR_NAMESPACE").as_deref(), Some("ns1"));
    assert_eq!(
        get("MESHCA_AUDIT_ANCHOR_CONFIGMAP").as_deref(),
        Some("r-meshca-audit-anchors")
    );
    assert_eq!(get("MESHCA_AUDIT_ANCHOR_INTERVAL").as_deref(), Some("60s"));
    assert_eq!(get("MESHCA_AUDIT_FSYNC").as_deref(), Some("batch"));

    // Turned off, neither the Role nor the key Secret is rendered.
    let off = Command::new(helm())
        .args(["template", "r"])
        .arg(repo().join("charts/meshca"))
        .args([
            "--set",
            "audit.anchor.enabled=false",
            "--set",
            "audit.checkpoint.generateKey=false",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8(off.stdout).unwrap();
    assert!(off.status.success());
    // (The denylist's own Role stays; tested with the kill switch.)
    let roles = role_names(&docs(&text));
    assert!(!roles.contains("r-meshca-audit-anchor"), "{roles:?}");
    assert!(roles.contains("r-meshca-denylist"), "{roles:?}");
    assert!(!text.contains("audit-checkpoint-key"));
    assert!(!text.contains("audit-prune"), "no prune without anchors");
}

/// (kind, name) of every Role and ClusterRole bound to ServiceAccount `sa`.
fn bound_to(docs: &[Value], sa: &str) -> BTreeSet<(String, String)> {
    docs.iter()
        .filter(|d| {
            matches!(
                d["kind"].as_str(),
                Some("RoleBinding" | "ClusterRoleBinding")
            )
        })
        .filter(|d| {
            d["subjects"].as_sequence().is_some_and(|s| {
                s.iter().any(|x| {
                    x["kind"].as_str() == Some("ServiceAccount") && x["name"].as_str() == Some(sa)
                })
            })
        })
        .map(|d| {
            (
                d["roleRef"]["kind"].as_str().unwrap().to_string(),
                d["roleRef"]["name"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Whoever holds the pod must not be able to rewrite or remove an anchor it
/// wrote: across the whole chart (default values, and ci-values.yaml, which
/// turns every feature on), no Role or ClusterRole grants a verb that
/// changes or removes a ConfigMap that could be an anchor (patch, update,
/// delete, deletecollection, or a wildcard), nor one that lets meshca grant
/// itself more (RBAC writes, bind, escalate, impersonate). A write verb on
/// ConfigMaps is allowed only with resourceNames, none of them the anchor
/// set's name or in its name space (`<set>.`).
#[test]
fn no_rbac_in_the_chart_lets_meshca_change_or_remove_an_anchor() {
    let changes = ["patch", "update", "delete", "deletecollection", "*"];
    let ci = repo()
        .join("charts/meshca/ci-values.yaml")
        .display()
        .to_string();
    for (what, flags) in [
        ("default values", vec![]),
        ("ci-values.yaml", vec!["-f", ci.as_str()]),
    ] {
        let docs = render_all(&flags);
        let set = env_of(
            docs.iter()
                .find(|d| d["kind"].as_str() == Some("Deployment"))
                .unwrap(),
        )
        .into_iter()
        .find(|(n, _)| n == "MESHCA_AUDIT_ANCHOR_CONFIGMAP")
        .map(|(_, v)| v)
        .unwrap();
        // The rules bound to meshca's own ServiceAccount (the prune
        // CronJob's Role, which may delete, is bound to its own one).
        let dep = of_kind(&docs, "Deployment")[0];
        let sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
            .as_str()
            .unwrap();
        let mine = bound_to(&docs, sa);
        assert!(
            !mine.iter().any(|(_, n)| n.ends_with("-audit-prune")),
            "{what}: the prune Role is bound to meshca: {mine:?}"
        );
        let own: Vec<Value> = docs
            .iter()
            .filter(|d| {
                let kind = d["kind"].as_str().unwrap_or("");
                let name = d["metadata"]["name"].as_str().unwrap_or("");
                mine.contains(&(kind.to_string(), name.to_string()))
            })
            .cloned()
            .collect();
        let mut rules = rules_of(&own, "Role");
        rules.extend(rules_of(&own, "ClusterRole"));
        assert!(rules.len() > 3, "{what}: {rules:?}");
        for r in &rules {
            let any = |s: &BTreeSet<String>, v: &str| s.contains(v) || s.contains("*");
            let core = any(&r.api_groups, "");
            for bad in ["bind", "escalate", "impersonate"] {
                assert!(!r.verbs.contains(bad), "{what}: {r:?}");
            }
            if any(&r.api_groups, "rbac.authorization.k8s.io") {
                assert!(
                    r.verbs
                        .iter()
                        .all(|v| ["get", "list", "watch"].contains(&v.as_str())),
                    "{what}: meshca may not write RBAC: {r:?}"
                );
            }
            if core && any(&r.resources, "configmaps") {
                let writes: Vec<_> = r
                    .verbs
                    .iter()
                    .filter(|v| changes.contains(&v.as_str()))
                    .collect();
                if writes.is_empty() {
                    continue;
                }
                assert!(
                    !r.resource_names.is_empty(),
                    "{what}: {writes:?} on every ConfigMap would reach the anchors: {r:?}"
                );
                for n in &r.resource_names {
                    assert!(
                        *n != set && !n.starts_with(&format!("{set}.")),
                        "{what}: {writes:?} on {n}, an anchor name: {r:?}"
                    );
                }
            }
        }
        // The anchor Role itself: create and read, nothing else.
        let anchor_role: Vec<Rule> = rules_of(
            &docs
                .iter()
                .filter(|d| {
                    d["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| n.ends_with("-audit-anchor"))
                })
                .cloned()
                .collect::<Vec<_>>(),
            "Role",
        );
        let cm = anchor_role
            .iter()
            .find(|r| r.resources.contains("configmaps"))
            .unwrap_or_else(|| panic!("{what}: no anchor Role"));
        assert_eq!(
            cm.verbs,
            ["create", "get", "list"].map(String::from).into(),
            "{what}"
        );
    }
}

const REMOTE_SECRETS_RBAC: &str = "tests/fixtures/rbac-remote-secrets.yaml";

#[test]
fn remote_secrets_role_is_exactly_the_fixture_and_namespaced() {
    let on = ["--set", "multiCluster.remoteSecrets=true"];
    let docs = render(
        "templates/role-remote-secrets.yaml",
        "meshca",
        "istio-system",
        &on,
    );
    assert_eq!(
        rules_of(&docs, "Role"),
        rules_of(
            &self::docs(&std::fs::read_to_string(repo().join(REMOTE_SECRETS_RBAC)).unwrap()),
            "Role"
        )
    );
    let binding = docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("RoleBinding"))
        .expect("RoleBinding");
    assert_eq!(
        binding["subjects"][0]["namespace"].as_str(),
        Some("istio-system")
    );
    // The watched namespace is the release namespace, and no cluster-wide
    // rule is added for it.
    let d = render("templates/deployment.yaml", "meshca", "istio-system", &on);
    let env = env_of(&d[0]);
    assert!(env.contains(&("MESHCA_REMOTE_SECRETS".into(), "true".into())));
    assert!(env.contains(&(
        "MESHCA_REMOTE_SECRETS_NAMESPACE".into(),
        "istio-system".into()
    )));
    assert!(env.contains(&(
        "PILOT_INSECURE_MULTICLUSTER_KUBECONFIG_OPTIONS".into(),
        String::new()
    )));
    assert_eq!(
        chart_rules(&on),
        chart_rules(&[]),
        "remote secrets add no ClusterRole rule"
    );
    // Off by default: no Role.
    let out = Command::new(helm())
        .args(["template", "meshca"])
        .arg(repo().join("charts/meshca"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let roles = role_names(&self::docs(&String::from_utf8_lossy(&out.stdout)));
    assert!(!roles.contains("meshca-remote-secrets"), "{roles:?}");
}

#[test]
fn pkcs11_signer_gets_its_uri_and_the_pin_from_a_secret_file() {
    let d = render("templates/deployment.yaml", "meshca", "istio-system", &[]);
    let env = env_of(&d[0]);
    assert!(env.contains(&("MESHCA_SIGNER".into(), "file".into())));
    assert!(env.contains(&("MESHCA_ISSUING_CA".into(), "auto".into())));
    let pod = &d[0]["spec"]["template"]["spec"];
    let has_pin_volume = |pod: &Value| {
        pod["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|v| v["name"].as_str() == Some("pkcs11-pin"))
    };
    assert!(!has_pin_volume(pod), "no PIN mount without a PIN Secret");

    let uri = "pkcs11:token=meshca;object=ica?module-path=/opt/hsm/lib.so&pin-source=file:/etc/meshca-pkcs11/pin";
    let d = render(
        "templates/deployment.yaml",
        "meshca",
        "istio-system",
        &[
            "--set-string",
            &format!("signer.uri={uri}"),
            "--set",
            "signer.pkcs11.pinSecretName=hsm-pin",
        ],
    );
    let env = env_of(&d[0]);
    assert!(env.contains(&("MESHCA_SIGNER".into(), uri.into())));
    let pod = &d[0]["spec"]["template"]["spec"];
    assert!(has_pin_volume(pod));
    let vol = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"].as_str() == Some("pkcs11-pin"))
        .unwrap();
    assert_eq!(vol["secret"]["secretName"].as_str(), Some("hsm-pin"));
    assert_eq!(vol["secret"]["items"][0]["key"].as_str(), Some("pin"));
    let mount = pod["containers"][0]["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["name"].as_str() == Some("pkcs11-pin"))
        .unwrap();
    assert_eq!(mount["mountPath"].as_str(), Some("/etc/meshca-pkcs11"));
    assert_eq!(mount["readOnly"].as_bool(), Some(true));
    // The PIN itself is never a value or an env var.
    assert!(!env.iter().any(|(k, _)| k == "MESHCA_PKCS11_PIN"));
}

const POD_CERT_RBAC: &str = "tests/fixtures/rbac-pod-certificate-signer.yaml";

#[test]
fn pod_certificate_signer_adds_exactly_the_signer_rules() {
    // Off by default: default_cluster_role_is_exactly_the_test_cluster_rbac has no such rule.
    let signer = ["--set", "podCertificates.signerName=meshca.test/spiffe"];
    let mut expected = fixture_rules(TESTENV_RBAC);
    expected.extend(fixture_rules(POD_CERT_RBAC));
    expected.sort();
    assert_eq!(chart_rules(&signer), expected);
    // The signer alone still reads pods (its own pod checks need the index).
    let mut alone = signer.to_vec();
    alone.extend([
        "--set-json",
        "trustedNodeAccounts=[]",
        "--set",
        "killSwitch.renewalPodCheck=false",
        "--set",
        "tokenVerification.mode=review",
    ]);
    assert!(chart_rules(&alone)
        .iter()
        .any(|r| r.resources.contains("pods")));
    // Without the trust bundle: no ClusterTrustBundle rights and no attest.
    let mut no_ctb = signer.to_vec();
    no_ctb.extend(["--set", "podCertificates.trustBundle=false"]);
    let got = chart_rules(&no_ctb);
    assert!(got
        .iter()
        .all(|r| !r.resources.contains("clustertrustbundles") && !r.verbs.contains("attest")));
    assert!(got.iter().any(|r| r.verbs.contains("sign")));
}

const CTB_RBAC: &str = "tests/fixtures/rbac-cluster-trust-bundle.yaml";

#[test]
fn cluster_trust_bundle_adds_exactly_the_publisher_rules() {
    // Off by default: default_cluster_role_is_exactly_the_test_cluster_rbac has no such rule.
    let on = ["--set", "clusterTrustBundle.enabled=true"];
    let mut expected = fixture_rules(TESTENV_RBAC);
    expected.extend(fixture_rules(CTB_RBAC));
    expected.sort();
    assert_eq!(chart_rules(&on), expected);
    // Another signer and an explicit name move attest and the named rule with them.
    let mut moved = on.to_vec();
    moved.extend([
        "--set",
        "clusterTrustBundle.signerName=mesh.example.com/ca",
        "--set",
        "clusterTrustBundle.name=mesh.example.com:ca:roots",
    ]);
    let text = std::fs::read_to_string(repo().join(CTB_RBAC))
        .unwrap()
        .replace("istio.io/istiod-ca", "mesh.example.com/ca")
        .replace("istio.io:istiod-ca:root-cert", "mesh.example.com:ca:roots");
    let mut expected = fixture_rules(TESTENV_RBAC);
    expected.extend(rules_of(&docs(&text), "ClusterRole"));
    expected.sort();
    assert_eq!(chart_rules(&moved), expected);
}

/// Every document of the whole chart rendered with `flags`.
fn render_all(flags: &[&str]) -> Vec<Value> {
    helm_template("meshca", "istio-system", flags)
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some(kind))
        .collect()
}

fn dashboard_maps(docs: &[Value]) -> Vec<&Value> {
    of_kind(docs, "ConfigMap")
        .into_iter()
        .filter(|d| d["data"].get("meshca.json").is_some())
        .collect()
}

#[test]
fn alerts_and_dashboard_are_off_by_default() {
    let all = render_all(&[]);
    assert!(of_kind(&all, "PrometheusRule").is_empty());
    assert!(dashboard_maps(&all).is_empty());
}

#[test]
fn alerts_are_one_prometheus_rule_with_one_value() {
    let all = render_all(&["--set", "alerts.enabled=true"]);
    let rules = of_kind(&all, "PrometheusRule");
    assert_eq!(rules.len(), 1);
    let r = rules[0];
    assert_eq!(r["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(r["metadata"]["namespace"], "istio-system");
    let groups: Vec<&str> = r["spec"]["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|g| g["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        groups,
        [
            "meshca.availability",
            "meshca.ca",
            "meshca.serving",
            "meshca.audit",
            "meshca.security"
        ]
    );
    // The dashboard stays off.
    assert!(dashboard_maps(&all).is_empty());

    // Object labels, alert labels and thresholds come from values.
    let all = render_all(&[
        "--set",
        "alerts.enabled=true",
        "--set",
        "alerts.labels.release=prometheus",
        "--set",
        "alerts.alertLabels.team=mesh",
        "--set",
        "alerts.ca.signingWarningDays=45",
    ]);
    let r = of_kind(&all, "PrometheusRule")[0];
    assert_eq!(r["metadata"]["labels"]["release"], "prometheus");
    let rules: Vec<&Value> = r["spec"]["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_sequence().unwrap())
        .collect();
    assert!(rules.iter().all(|r| r["labels"]["team"] == "mesh"));
    assert!(rules
        .iter()
        .any(|r| r["alert"] == "MeshcaSigningCertificateExpiring"
            && r["expr"].as_str().unwrap().ends_with("< 45")));
}

#[test]
fn dashboard_is_a_configmap_the_grafana_sidecar_picks_up() {
    let all = render_all(&["--set", "dashboard.enabled=true"]);
    let maps = dashboard_maps(&all);
    assert_eq!(maps.len(), 1);
    let cm = maps[0];
    assert_eq!(cm["metadata"]["name"], "meshca-dashboard");
    assert_eq!(cm["metadata"]["namespace"], "istio-system");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    // Shipped as is: the ConfigMap holds exactly the JSON file.
    let shipped: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("charts/meshca/dashboards/meshca.json")).unwrap(),
    )
    .unwrap();
    let held: serde_json::Value =
        serde_json::from_str(cm["data"]["meshca.json"].as_str().unwrap()).unwrap();
    assert_eq!(held, shipped);
    assert!(of_kind(&all, "PrometheusRule").is_empty());

    // Label key and value, namespace and annotations are values.
    let all = render_all(&[
        "--set",
        "dashboard.enabled=true",
        "--set",
        "dashboard.labelKey=dashboards.example.com/grafana",
        "--set",
        "dashboard.labelValue=mesh",
        "--set",
        "dashboard.namespace=monitoring",
        "--set",
        "dashboard.annotations.grafana_folder=Mesh",
    ]);
    let cm = dashboard_maps(&all)[0];
    assert_eq!(cm["metadata"]["namespace"], "monitoring");
    assert_eq!(
        cm["metadata"]["labels"]["dashboards.example.com/grafana"],
        "mesh"
    );
    assert!(cm["metadata"]["labels"].get("grafana_dashboard").is_none());
    assert_eq!(cm["metadata"]["annotations"]["grafana_folder"], "Mesh");
}

/// The anchor lag alert is measured in anchor intervals: a checkpoint
/// normally waits up to one (`audit.anchor.interval`), so the threshold is
/// a multiple of the interval meshca exports, never a fixed time that a
/// longer interval would trip in normal operation; a multiple of one or
/// less would fire on every periodic checkpoint and is refused.
#[test]
fn anchor_lag_alert_is_counted_in_anchor_intervals() {
    let expr = |flags: &[&str]| {
        let mut all = vec!["--set", "alerts.enabled=true"];
        all.extend_from_slice(flags);
        let docs = render_all(&all);
        let r = of_kind(&docs, "PrometheusRule")[0];
        r["spec"]["groups"]
            .as_sequence()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_sequence().unwrap())
            .find(|r| r["alert"] == "MeshcaAuditAnchorLagging")
            .unwrap()["expr"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(
        expr(&[]),
        "meshca_audit_anchor_pending_seconds > 3 * meshca_audit_anchor_interval_seconds"
    );
    assert_eq!(
        expr(&["--set-json", "alerts.audit.anchorLagIntervals=1.5"]),
        "meshca_audit_anchor_pending_seconds > 1.5 * meshca_audit_anchor_interval_seconds"
    );
    for bad in ["1", "0.5"] {
        let out = Command::new(helm())
            .args(["template", "meshca"])
            .arg(repo().join("charts/meshca"))
            .args([
                "--set",
                "alerts.enabled=true",
                "--set-json",
                &format!("alerts.audit.anchorLagIntervals={bad}"),
            ])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && stderr.contains("anchorLagIntervals")
                && !stderr.contains("want number"),
            "anchorLagIntervals={bad} was accepted: {stderr}"
        );
    }
}

/// GitOps renders the chart with `helm template` on every sync (Argo CD,
/// Flux): two renders must be byte-identical, or each sync would replace
/// something. On the chart before meshca made its own checkpoint key, the
/// `genPrivateKey` Secret differed on every render.
#[test]
fn helm_template_renders_the_same_twice() {
    let ci = repo()
        .join("charts/meshca/ci-values.yaml")
        .display()
        .to_string();
    for flags in [vec![], vec!["-f", ci.as_str()]] {
        let text = || {
            let out = Command::new(helm())
                .args(["template", "meshca"])
                .arg(repo().join("charts/meshca"))
                .args(["--namespace", "istio-system"])
                .args(&flags)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap()
        };
        let (a, b) = (text(), text());
        assert!(a.len() > 1000);
        assert!(a == b, "two renders of {flags:?} differ");
        assert!(
            !a.contains("PRIVATE KEY") && !a.contains("LS0tLS1CRUdJTi"),
            "a key in the render"
        );
    }
}

fn pod_spec(docs: &[Value]) -> Value {
    of_kind(docs, "Deployment")[0]["spec"]["template"]["spec"].clone()
}

/// The defaults of the override points: node and zone spread (both
/// ScheduleAnyway, labelled with the pods' selector), the recommended
/// PriorityClass, a startup probe on /healthz, the image from appVersion.
#[test]
fn override_points_have_documented_defaults() {
    let all = render_all(&[]);
    let pod = pod_spec(&all);
    assert_eq!(
        pod["priorityClassName"].as_str(),
        Some("system-cluster-critical")
    );
    let spread = pod["topologySpreadConstraints"].as_sequence().unwrap();
    let keys: Vec<&str> = spread
        .iter()
        .map(|c| c["topologyKey"].as_str().unwrap())
        .collect();
    assert_eq!(
        keys,
        ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
    );
    for c in spread {
        assert_eq!(c["whenUnsatisfiable"].as_str(), Some("ScheduleAnyway"));
        assert_eq!(
            c["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"].as_str(),
            Some("meshca")
        );
    }
    let c = &pod["containers"][0];
    assert_eq!(c["image"].as_str(), Some("meshca:0.1.0"));
    assert_eq!(
        c["startupProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert_eq!(pod["securityContext"]["runAsUser"].as_u64(), Some(65532));
    assert_eq!(pod["securityContext"]["fsGroup"].as_u64(), Some(65532));
    // Off: no spread, no probe, no priority.
    let pod = pod_spec(&render_all(&[
        "--set",
        "topologySpreadConstraints=null",
        "--set",
        "startupProbe=null",
        "--set",
        "priorityClassName=",
    ]));
    assert!(pod.get("topologySpreadConstraints").is_none());
    assert!(pod["containers"][0].get("startupProbe").is_none());
    assert!(pod.get("priorityClassName").is_none());
}

/// Every new value set at once, and each one found where it belongs.
#[test]
fn every_override_point_is_rendered() {
    let digest = format!("sha256:{}", "ab".repeat(32));
    let digest_flag = format!("image.digest={digest}");
    let all = render_all(&[
        "--set",
        "image.registry=registry.example.com/mesh/",
        "--set",
        "image.repository=ca/meshca",
        "--set",
        "image.tag=v9",
        "--set",
        "image.pullPolicy=Always",
        "--set",
        "extraEnv[0].name=SOFTHSM2_CONF",
        "--set",
        "extraEnv[0].value=/etc/softhsm/softhsm2.conf",
        "--set",
        "extraVolumes[0].name=module",
        "--set",
        "extraVolumes[0].hostPath.path=/usr/lib/softhsm",
        "--set",
        "extraVolumeMounts[0].name=module",
        "--set",
        "extraVolumeMounts[0].mountPath=/usr/lib/softhsm",
        "--set",
        "extraVolumeMounts[0].readOnly=true",
        "--set",
        "topologySpreadConstraints[0].maxSkew=2",
        "--set",
        "topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
        "--set",
        "topologySpreadConstraints[0].whenUnsatisfiable=DoNotSchedule",
        "--set",
        "podSecurityContext.runAsUser=null",
        "--set",
        "podSecurityContext.runAsGroup=null",
        "--set",
        "podSecurityContext.fsGroup=null",
        "--set",
        "securityContext.readOnlyRootFilesystem=true",
        "--set",
        "securityContext.runAsUser=null",
        "--set",
        "startupProbe.failureThreshold=7",
        "--set",
        "priorityClassName=mesh-critical",
        "--set",
        "audit.anchor.prune.olderThan=48h",
        "--set",
        "audit.anchor.prune.schedule=*/5 * * * *",
        "--set",
        "audit.anchor.prune.timeZone=Etc/UTC",
        "--set",
        "audit.anchor.prune.dryRun=true",
        "--set",
        "audit.anchor.prune.activeDeadlineSeconds=120",
        "--set",
        "audit.anchor.prune.resources.limits.memory=99Mi",
    ]);
    let pod = pod_spec(&all);
    let c = &pod["containers"][0];
    assert_eq!(
        c["image"].as_str(),
        Some("registry.example.com/mesh/ca/meshca:v9")
    );
    assert_eq!(c["imagePullPolicy"].as_str(), Some("Always"));
    let env = env_of(&of_kind(&all, "Deployment")[0].clone());
    assert_eq!(
        env.last(),
        Some(&("SOFTHSM2_CONF".into(), "/etc/softhsm/softhsm2.conf".into())),
        "extraEnv comes after the chart's"
    );
    let vol = pod["volumes"]
        .as_sequence()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(vol["name"].as_str(), Some("module"));
    assert_eq!(vol["hostPath"]["path"].as_str(), Some("/usr/lib/softhsm"));
    let mount = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(mount["mountPath"].as_str(), Some("/usr/lib/softhsm"));
    assert_eq!(mount["readOnly"].as_bool(), Some(true));
    let spread = pod["topologySpreadConstraints"].as_sequence().unwrap();
    assert_eq!(spread.len(), 1, "the list replaces the default");
    assert_eq!(spread[0]["maxSkew"].as_u64(), Some(2));
    assert_eq!(
        spread[0]["whenUnsatisfiable"].as_str(),
        Some("DoNotSchedule")
    );
    assert_eq!(
        spread[0]["labelSelector"]["matchLabels"]["app.kubernetes.io/name"].as_str(),
        Some("meshca")
    );
    // OpenShift: no fixed user, group or fsGroup; the rest stays.
    let psc = &pod["securityContext"];
    for k in ["runAsUser", "runAsGroup", "fsGroup"] {
        assert!(psc.get(k).is_none(), "{k}: {psc:?}");
    }
    assert_eq!(psc["runAsNonRoot"].as_bool(), Some(true));
    assert!(c["securityContext"].get("runAsUser").is_none());
    assert_eq!(
        c["securityContext"]["capabilities"]["drop"][0].as_str(),
        Some("ALL")
    );
    assert_eq!(c["startupProbe"]["failureThreshold"].as_u64(), Some(7));
    assert_eq!(pod["priorityClassName"].as_str(), Some("mesh-critical"));

    let job = &of_kind(&all, "CronJob")[0]["spec"];
    assert_eq!(job["schedule"].as_str(), Some("*/5 * * * *"));
    assert_eq!(job["timeZone"].as_str(), Some("Etc/UTC"));
    let jspec = &job["jobTemplate"]["spec"];
    assert_eq!(jspec["activeDeadlineSeconds"].as_u64(), Some(120));
    let pc = &jspec["template"]["spec"]["containers"][0];
    assert_eq!(pc["image"], c["image"], "the prune runs the meshca image");
    let args: Vec<&str> = pc["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.contains(&"--older-than=48h") && args.contains(&"--dry-run"),
        "{args:?}"
    );
    assert_eq!(pc["resources"]["limits"]["memory"].as_str(), Some("99Mi"));

    // A digest wins over the tag.
    let pod = pod_spec(&render_all(&[
        "--set",
        &digest_flag,
        "--set",
        "image.tag=v9",
    ]));
    assert_eq!(
        pod["containers"][0]["image"].as_str(),
        Some(format!("meshca@{digest}").as_str())
    );
    // extraEnv may not repeat a variable the chart sets from a value.
    let out = Command::new(helm())
        .args(["template", "meshca"])
        .arg(repo().join("charts/meshca"))
        .args([
            "--set",
            "extraEnv[0].name=TRUST_DOMAIN",
            "--set",
            "extraEnv[0].value=x",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("extraEnv sets TRUST_DOMAIN"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The prune CronJob: `meshca audit prune-anchors` as the container command
/// (the image has no shell), with the set and namespace meshca anchors to,
/// under its own ServiceAccount whose Role is list and delete of ConfigMaps
/// and nothing else; meshca's ServiceAccount is not bound to it.
#[test]
fn anchor_prune_is_a_cronjob_with_only_what_prune_needs() {
    let all = render_all(&[]);
    let jobs = of_kind(&all, "CronJob");
    assert_eq!(jobs.len(), 1, "on by default");
    let spec = &jobs[0]["spec"]["jobTemplate"]["spec"]["template"]["spec"];
    let c = &spec["containers"][0];
    assert_eq!(c["command"][0].as_str(), Some("/usr/local/bin/meshca"));
    let args: Vec<&str> = c["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(
        args,
        [
            "audit",
            "prune-anchors",
            "--older-than=168h",
            "--anchor-namespace=istio-system",
            "--anchor-configmap=meshca-audit-anchors"
        ]
    );
    let dep_env = env_of(&of_kind(&all, "Deployment")[0].clone());
    assert!(dep_env.contains(&(
        "MESHCA_AUDIT_ANCHOR_CONFIGMAP".into(),
        "meshca-audit-anchors".into()
    )));
    assert_eq!(
        c["securityContext"]["readOnlyRootFilesystem"].as_bool(),
        Some(true)
    );
    let sa = spec["serviceAccountName"].as_str().unwrap();
    assert_eq!(sa, "meshca-audit-prune");
    assert_ne!(
        pod_spec(&all)["serviceAccountName"].as_str(),
        Some(sa),
        "meshca never runs as the prune ServiceAccount"
    );
    let bound = bound_to(&all, sa);
    assert_eq!(
        bound,
        [("Role".to_string(), "meshca-audit-prune".to_string())].into()
    );
    let role: Vec<Value> = of_kind(&all, "Role")
        .into_iter()
        .filter(|d| d["metadata"]["name"].as_str() == Some("meshca-audit-prune"))
        .cloned()
        .collect();
    assert_eq!(
        rules_of(&role, "Role"),
        vec![Rule {
            api_groups: [String::new()].into(),
            resources: ["configmaps".to_string()].into(),
            resource_names: BTreeSet::new(),
            verbs: ["delete", "list"].map(String::from).into(),
        }]
    );
    // The admission policy that keeps its delete to the anchors is exactly
    // the one tests/kube_audit_prune.rs checks in the API server.
    let strip = |d: &Value| {
        let mut d = d.clone();
        d["metadata"].as_mapping_mut().unwrap().remove("labels");
        d
    };
    let policy: Vec<Value> = all
        .iter()
        .filter(|d| {
            d["kind"]
                .as_str()
                .is_some_and(|k| k.starts_with("ValidatingAdmissionPolicy"))
                && d["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.contains("-audit-prune."))
        })
        .map(strip)
        .collect();
    let fixture =
        docs(&std::fs::read_to_string(repo().join("tests/fixtures/vap-audit-prune.yaml")).unwrap());
    assert_eq!(policy, fixture);
    let off = render_all(&["--set", "audit.anchor.prune.enabled=false"]);
    assert!(of_kind(&off, "CronJob").is_empty());
    assert!(!of_kind(&off, "ValidatingAdmissionPolicy")
        .iter()
        .any(|d| d["metadata"]["name"]
            .as_str()
            .is_some_and(|n| n.contains("-audit-prune."))));
    assert!(!role_names(&off).contains("meshca-audit-prune"));
}
