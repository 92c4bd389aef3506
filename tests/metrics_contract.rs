//! The chart's alerts and dashboard read only what meshca exports: a real
//! server gets real traffic (an allow, each refusal class reachable without
//! Kubernetes, a shed, a refused CA reload, a rejected handshake), its
//! /metrics is scraped, and every metric, label and label value that a rule
//! or a panel query selects (read from the chart as helm renders it) must be
//! in the scrape. A renamed metric, label or reason code fails here.
//!
//! What exists only with Kubernetes (the pod index, a caller's node, the
//! TokenReview path, audit anchors) is listed in [`KUBE_ONLY`] with the
//! reason, and checked against a server on the real kube-apiserver in
//! `kube_only_metrics_exist_with_the_api_server`. Nothing is skipped: a need
//! that neither scrape has fails one of the two tests.
#![allow(clippy::unwrap_used)]

mod common;
mod monitoring;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use meshca::admission::{AdmissionConfig, IdentityCap};
use meshca::app::{App, Deps};
use meshca::ca::generate::KeyType;
use meshca::ca::CaBundle;
use meshca::testing::{
    self, client, client_identity, csr_for, request, string_value, validity_hours, TestPki,
};
use monitoring::{all_needs, parse_scrape, satisfied, Need, Sample};
use rustls_pki_types::pem::PemObject;
use time::OffsetDateTime;
use tonic::Code;

/// Metrics that exist only with Kubernetes on, and why.
const KUBE_ONLY: &[(&str, &str)] = &[
    ("meshca_pod_index_pods", "the pod index is a Kubernetes watch"),
    ("meshca_pod_index_synced", "the pod index is a Kubernetes watch"),
    ("meshca_pod_index_disconnected_seconds", "the pod index is a Kubernetes watch"),
    ("meshca_pod_index_max_staleness_seconds", "exported beside the pod index"),
    ("meshca_index_freshness_age_seconds", "the indexes are Kubernetes watches"),
    ("meshca_cluster_synced", "the cluster registry holds Kubernetes clusters"),
    (
        "meshca_node_refusals_total",
        "a caller's node comes from its token's pod binding, verified by the API server or the issuer keys",
    ),
    ("meshca_tokenreviews_total", "TokenReviews are sent to the API server"),
    ("meshca_token_verifications_total", "token verification needs the API server"),
    ("meshca_token_cache_hit_ratio", "exported with the TokenReview authenticator"),
    ("meshca_audit_anchor_pending_seconds", "anchors are ConfigMaps"),
    ("meshca_audit_anchor_interval_seconds", "exported while anchoring is on"),
    ("meshca_audit_anchor_writes_total", "anchors are ConfigMaps"),
];

/// Label values met only with Kubernetes, and why.
const KUBE_ONLY_VALUES: &[(&str, &str, &str, &str)] = &[(
    "meshca_decisions_total",
    "reason",
    "token_",
    "token refusals need a token authenticator (TokenReview or issuer keys)",
)];

/// Label values a selector names that this traffic cannot produce, checked
/// instead as a value of the same label on another metric that exports
/// every value from the start (same reason code constant).
const SAME_CODE_ON: &[(&str, &str, &str, &str, &str)] = &[
    (
        "meshca_decisions_total",
        "reason",
        "audit_queue_full",
        "meshca_audit_shed_total",
        "a full audit queue needs a stalled writer (tests/audit_stall.rs); the refusal's reason is the shed's",
    ),
    (
        "meshca_decisions_total",
        "reason",
        "tokenreview_budget_exhausted",
        "meshca_tokenreview_refused_total",
        "the TokenReview budget needs the API server; the refusal's reason is the budget's",
    ),
    (
        "meshca_decisions_total",
        "reason",
        "tokenreview_inflight_exhausted",
        "meshca_tokenreview_refused_total",
        "the TokenReview in-flight cap needs the API server; the refusal's reason is the budget's",
    ),
];

fn kube_only(need: &Need) -> bool {
    let metric_kube = |m: &str| KUBE_ONLY.iter().any(|(k, _)| *k == m);
    match need {
        Need::Metric(m) | Need::Label(m, _) | Need::Value(m, _, _) => {
            metric_kube(m) || is_kube_value(need)
        }
        Need::Prefix(m, ..) => metric_kube(m) || is_kube_value(need),
        Need::Grouping(ms, _) => ms.iter().all(|m| metric_kube(m)),
    }
}

fn is_kube_value(need: &Need) -> bool {
    match need {
        Need::Prefix(m, l, p) | Need::Value(m, l, p) => KUBE_ONLY_VALUES
            .iter()
            .any(|(km, kl, kp, _)| km == m && kl == l && p.starts_with(kp)),
        _ => false,
    }
}

fn same_code_on(need: &Need) -> Option<Need> {
    let Need::Value(m, l, v) = need else {
        return None;
    };
    SAME_CODE_ON
        .iter()
        .find(|(sm, sl, sv, ..)| sm == m && sl == l && sv == v)
        .map(|(_, sl, sv, other, _)| Need::Value(other.to_string(), sl.to_string(), sv.to_string()))
}

/// The needs nobody checks any more must not linger in the lists above.
fn assert_lists_are_used(needs: &BTreeMap<Need, Vec<String>>) {
    for (m, why) in KUBE_ONLY {
        assert!(
            needs.keys().any(|n| matches!(n, Need::Metric(x) if x == m)),
            "KUBE_ONLY lists {m} ({why}), which no rule or panel uses"
        );
    }
    for (m, l, v, _, _) in SAME_CODE_ON {
        assert!(
            needs.contains_key(&Need::Value(m.to_string(), l.to_string(), v.to_string())),
            "SAME_CODE_ON lists {m}{{{l}={v}}}, which no rule or panel uses"
        );
    }
    for (m, l, p, _) in KUBE_ONLY_VALUES {
        assert!(
            needs.keys().any(|n| matches!(n, Need::Prefix(x, y, z) | Need::Value(x, y, z) if x == m && y == l && z.starts_with(p))),
            "KUBE_ONLY_VALUES lists {m}{{{l}=~{p}.*}}, which no rule or panel uses"
        );
    }
}

/// The needs `samples` do not satisfy, with who needs them.
fn unmet(
    needs: &BTreeMap<Need, Vec<String>>,
    samples: &[Sample],
    pick: impl Fn(&Need) -> bool,
) -> Vec<String> {
    needs
        .iter()
        .filter(|(n, _)| pick(n))
        .filter(|(n, _)| {
            let n = same_code_on(n).unwrap_or_else(|| (*n).clone());
            !satisfied(&n, samples)
        })
        .map(|(n, who)| format!("{n} (used by {})", who.join(", ")))
        .collect()
}

async fn scrape(addr: std::net::SocketAddr) -> String {
    let (status, body) = testing::http_get(addr, "/metrics").await;
    assert_eq!(status, 200);
    body
}

async fn mtls(
    app: &App,
    pki: &TestPki,
    bundle: &CaBundle,
    id: &str,
) -> meshca::proto::istio_certificate_service_client::IstioCertificateServiceClient<
    tonic::transport::Channel,
> {
    let (cert, key) = client_identity(bundle, id, &validity_hours(-1, 1));
    client(app.addr, &pki.ca.root_cert, Some((&cert, &key)))
        .await
        .unwrap()
}

fn serial_of(pem: &str) -> String {
    let der = rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
    let (_, c) = x509_parser::parse_x509_certificate(&der).unwrap();
    meshca::ca::serial_hex(c.raw_serial())
}

async fn wait_for(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f().await {
        assert!(Instant::now() < deadline, "never happened: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_and_dashboard_use_is_exported() {
    let needs = all_needs();
    assert_lists_are_used(&needs);

    let pki = TestPki::new(KeyType::EcdsaP256);
    let dir = tempfile::tempdir().unwrap();
    let (revoked_file, deny_file) = (
        dir.path().join("revoked.jsonl"),
        dir.path().join("denylist"),
    );
    let denied = "spiffe://cluster.local/ns/shop/sa/denied";
    std::fs::write(&deny_file, format!("identity {denied}\n")).unwrap();
    std::fs::write(&revoked_file, "").unwrap();
    let mut cfg = testing::test_config(pki.path_buf());
    cfg.kill_switch.denylist = meshca::denylist::DenylistSettings {
        file: Some(deny_file),
        poll: Duration::from_millis(100),
        configmap: None,
    };
    // The file store (per process; a cluster shares a ConfigMap store).
    cfg.kill_switch.revocation = Some(meshca::revocation::RevocationSettings::file(
        revoked_file.clone(),
        Duration::from_millis(100),
    ));
    cfg.admission = AdmissionConfig {
        identity_cap: Some(IdentityCap {
            max: 1,
            window: Duration::from_secs(3600),
        }),
        ..AdmissionConfig::default()
    };
    let (app, audit) = testing::start_server(&cfg, Deps::default()).await;
    let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
    let ask = |id: &str| request(csr_for(&rcgen::KeyPair::generate().unwrap(), id), 0, &[]);

    // An allow, then the identity cap's shed for the same identity.
    let capped = "spiffe://cluster.local/ns/shop/sa/cart";
    let mut c = mtls(&app, &pki, &bundle, capped).await;
    c.create_certificate(ask(capped)).await.unwrap();
    let st = c.create_certificate(ask(capped)).await.unwrap_err();
    assert_eq!(st.code(), Code::ResourceExhausted);
    // CSR for another identity; a TTL over the maximum; impersonation that is not configured.
    let web = "spiffe://cluster.local/ns/shop/sa/web";
    let mut c = mtls(&app, &pki, &bundle, web).await;
    let st = c
        .create_certificate(ask("spiffe://cluster.local/ns/shop/sa/other"))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::InvalidArgument);
    let k = rcgen::KeyPair::generate().unwrap();
    let st = c
        .create_certificate(request(csr_for(&k, web), 10 * 365 * 86400, &[]))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::InvalidArgument);
    let st = c
        .create_certificate(request(
            csr_for(&k, web),
            0,
            &[("ImpersonatedIdentity", string_value(capped))],
        ))
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::Unauthenticated);
    // No credentials at all.
    let mut anon = client(app.addr, &pki.ca.root_cert, None).await.unwrap();
    let st = anon.create_certificate(ask(web)).await.unwrap_err();
    assert_eq!(st.code(), Code::Unauthenticated);
    // The denylist.
    let mut c = mtls(&app, &pki, &bundle, denied).await;
    let st = c.create_certificate(ask(denied)).await.unwrap_err();
    assert_eq!(st.code(), Code::Unauthenticated, "{st:?}");
    // A revoked client certificate.
    let gone = "spiffe://cluster.local/ns/shop/sa/gone";
    let (cert, key) = client_identity(&bundle, gone, &validity_hours(-1, 1));
    let revoked_at = OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    std::fs::write(
        &revoked_file,
        format!(
            "{}\n",
            serde_json::json!({"serial": serial_of(&cert), "reason": "key-compromise", "revoked_at": revoked_at})
        ),
    )
    .unwrap();
    wait_for("the revoked certificate is refused", async || {
        let mut c = client(app.addr, &pki.ca.root_cert, Some((&cert, &key)))
            .await
            .unwrap();
        c.create_certificate(ask(gone)).await.is_err()
            && audit
                .requests()
                .last()
                .is_some_and(|r| r.reason == "mtls_cert_revoked")
    })
    .await;
    // A TLS handshake that fails.
    {
        use tokio::io::AsyncWriteExt;
        let mut s = tokio::net::TcpStream::connect(app.addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    }
    // CA material that does not belong together: the reload is refused.
    let other = TestPki::new(KeyType::EcdsaP256);
    std::fs::copy(
        other.path().join("ca-cert.pem"),
        pki.path().join("ca-cert.pem"),
    )
    .unwrap();
    wait_for("a refused CA reload is counted", async || {
        scrape(app.admin_addr)
            .await
            .contains("meshca_ca_reloads_total{result=")
    })
    .await;
    wait_for("the handshake is counted", async || {
        !scrape(app.admin_addr)
            .await
            .contains("meshca_transport_refusals_total{reason=\"handshake_failed\"} 0")
    })
    .await;

    let text = scrape(app.admin_addr).await;
    let samples = parse_scrape(&text);
    let missing = unmet(&needs, &samples, |n| !kube_only(n));
    assert!(
        missing.is_empty(),
        "the rules and the dashboard use what /metrics does not have:\n  {}\n\nscrape:\n{text}",
        missing.join("\n  ")
    );
    // The traffic really was what the needs above were checked against.
    for reason in [
        "issued",
        "admission_identity_cap",
        "csr_san_not_authorized",
        "ttl_too_long",
        "impersonation_not_configured",
        "authn_no_credentials",
        "denylist_identity",
        "mtls_cert_revoked",
    ] {
        assert!(
            samples.iter().any(|s| s.name == "meshca_decisions_total"
                && s.labels.get("reason").map(String::as_str) == Some(reason)),
            "no decision {reason}"
        );
    }
    // The audit log's own state is exported from the start (no rule or
    // panel reads these yet; the names are part of the contract).
    for name in [
        "meshca_audit_unauthenticated_folded_total",
        "meshca_audit_files_retained",
        "meshca_audit_anchor_heads_rejected_total",
    ] {
        assert!(
            samples.iter().any(|s| s.name == name),
            "no {name} in the scrape"
        );
    }
    // The revocation was read from the store as an event of its own, not
    // only exported from zero.
    let line = "meshca_revocation_events_total{reason=\"revoked\"} 1";
    assert!(
        text.lines().any(|l| l == line),
        "missing {line:?} in\n{text}"
    );
    app.shutdown().await.unwrap();
}

/// The metrics of [`KUBE_ONLY`] against a server on the real
/// kube-apiserver: a node proxy refused an identity with no pod on its node,
/// a token refused, the pod index and the cluster registry, and audit
/// checkpoints anchored as ConfigMaps by the real audit writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_only_metrics_exist_with_the_api_server() {
    let needs = all_needs();
    let k = common::kte().await;
    let ns = k.namespace("metrics").await;
    // The chart's anchor RBAC for the test user `meshca`.
    k.meshca_role(&ns, "tests/fixtures/rbac-audit-anchor.yaml")
        .await;
    let (_, zt_token) = k
        .pod_token(&ns, "ztunnel", "ztunnel-a", "node-metrics")
        .await;

    let pki = TestPki::new(KeyType::EcdsaP256);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::kube_config(&pki, k.meshca_kubeconfig(), &[format!("{ns}/ztunnel")]);
    cfg.audit.sink = meshca::config::AuditSinkKind::File;
    cfg.audit.file = dir.path().join("audit.log");
    cfg.audit.anchor = Some(meshca::config::AnchorTarget {
        namespace: ns.clone(),
        set: "meshca-audit-anchors".into(),
        interval: Duration::from_secs(60),
    });
    cfg.audit.checkpoint_interval = Duration::from_secs(1);
    cfg.audit.writer.checkpoint_interval = Duration::from_secs(1);
    let app = App::start(&cfg, Deps::default()).await.unwrap();
    let index = app.pod_index.clone().expect("pod index");
    wait_for("the pod index syncs and shows the node proxy", async || {
        index.is_synced() && index.read(|s| s.get(&ns, "ztunnel-a").is_some())
    })
    .await;

    let call = |token: String, id: String, impersonate: Option<String>| {
        let (addr, root) = (app.addr, pki.ca.root_cert.clone());
        async move {
            let mut c = client(addr, &root, None).await.unwrap();
            let key = rcgen::KeyPair::generate().unwrap();
            let meta: Vec<(&str, prost_types::Value)> = impersonate
                .iter()
                .map(|i| ("ImpersonatedIdentity", string_value(i)))
                .collect();
            let mut req = tonic::Request::new(request(csr_for(&key, &id), 0, &meta));
            req.metadata_mut()
                .insert("authorization", format!("Bearer {token}").parse().unwrap());
            req.metadata_mut()
                .insert("clusterid", "Kubernetes".parse().unwrap());
            c.create_certificate(req).await
        }
    };
    // The node proxy asks for an identity with no pod on its node, twice.
    let nobody = common::spiffe(&ns, "nobody");
    for _ in 0..2 {
        let st = call(zt_token.clone(), nobody.clone(), Some(nobody.clone()))
            .await
            .unwrap_err();
        assert_eq!(st.code(), Code::Unauthenticated, "{st:?}");
    }
    // A token that is not a JWT.
    let st = call("not-a-jwt".into(), nobody.clone(), None)
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::Unauthenticated);

    let mut text = String::new();
    wait_for("a checkpoint is anchored", async || {
        text = scrape(app.admin_addr).await;
        text.contains("meshca_audit_anchor_writes_total{result=\"written\"} ")
            && !text.contains("meshca_audit_anchor_writes_total{result=\"written\"} 0")
    })
    .await;
    let samples = parse_scrape(&text);
    let line = "meshca_node_refusals_total{node=\"node-metrics\",reason=\"impersonation_no_pod_on_node\"} 2";
    assert!(
        text.lines().any(|l| l == line),
        "missing {line:?} in\n{text}"
    );
    let missing = unmet(&needs, &samples, kube_only);
    assert!(
        missing.is_empty(),
        "the rules and the dashboard use what /metrics does not have with Kubernetes:\n  {}\n\nscrape:\n{text}",
        missing.join("\n  ")
    );
    // Checked here, so not silently nowhere.
    assert!(needs.keys().any(kube_only), "no need was Kubernetes-only?");
    app.shutdown().await.unwrap();
}
