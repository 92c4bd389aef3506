//! The API server goes away mid-test and comes back: meshca keeps serving
//! from its index, never allows what it should not, reconnects, and picks up
//! changes made while its watch was disconnected. Its own test binary so the
//! outage cannot disturb other tests (cargo runs test binaries one by one).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{kte, kte_script, spiffe, start};
use meshca::ca::generate::KeyType;
use meshca::testing::TestPki;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_outage_and_recovery() {
    let k = kte().await;
    let zt_ns = k.namespace("zt").await;
    k.service_account(&zt_ns, "ztunnel").await;
    let zt_uid = k.pod(&zt_ns, "ztunnel-a", "ztunnel", "node-a").await;
    let zt_token = k
        .token(&zt_ns, "ztunnel", Some(("ztunnel-a", &zt_uid)), "istio-ca")
        .await;
    let ns = k.namespace("app").await;
    for sa in ["app", "far", "newsa"] {
        k.service_account(&ns, sa).await;
    }
    let app_uid = k.pod(&ns, "app-0", "app", "node-a").await;
    k.pod(&ns, "far-0", "far", "node-b").await;
    // Minted now, first presented during the outage: never reviewed.
    let unseen_token = k
        .token(&ns, "app", Some(("app-0", &app_uid)), "istio-ca")
        .await;
    let trusted = [format!("{zt_ns}/ztunnel")];

    let pki = TestPki::new(KeyType::EcdsaP256);
    let srv = start(
        common::kube_config(&pki, k.meshca_kubeconfig(), &trusted),
        pki,
    )
    .await;
    let n = ns.clone();
    srv.wait_index("workloads", move |s| {
        s.get(&n, "app-0").is_some() && s.get(&n, "far-0").is_some()
    })
    .await;
    let (app, far, newsa) = (spiffe(&ns, "app"), spiffe(&ns, "far"), spiffe(&ns, "newsa"));
    srv.call(&zt_token, &app, Some(&app), Some("Kubernetes"))
        .await
        .unwrap();
    assert_eq!(srv.readyz().await, 200);

    kte_script("stop-apiserver", &k.dir);
    let outage_started = Instant::now();

    // Served from the index and the review cache.
    for _ in 0..5 {
        srv.call(&zt_token, &app, Some(&app), Some("Kubernetes"))
            .await
            .expect("cached caller, indexed pod");
    }
    // Never a wrong allow.
    let r = srv
        .call(&zt_token, &far, Some(&far), Some("Kubernetes"))
        .await;
    assert_eq!(r.unwrap_err().code(), Code::Unauthenticated);
    assert_eq!(srv.last_reason().as_str(), "impersonation_no_pod_on_node");
    // A token nobody has reviewed cannot be checked: retryable, not allowed.
    let r = srv.call(&unseen_token, &app, None, None).await;
    assert_eq!(r.unwrap_err().code(), Code::Unavailable);
    assert_eq!(srv.last_reason().as_str(), "authn_tokenreview_unavailable");
    assert_eq!(
        srv.readyz().await,
        200,
        "a synced index stays ready through an outage"
    );

    // A replica started during the outage has no index: not ready, and
    // impersonation is refused as retryable.
    let pki2 = TestPki::new(KeyType::EcdsaP256);
    let cold = start(
        common::kube_config(&pki2, k.meshca_kubeconfig(), &trusted),
        pki2,
    )
    .await;
    assert_eq!(cold.readyz().await, 503);
    let r = cold
        .call(&zt_token, &app, Some(&app), Some("Kubernetes"))
        .await;
    assert_eq!(r.unwrap_err().code(), Code::Unavailable);

    tokio::time::sleep(Duration::from_secs(3)).await;
    kte_script("start-apiserver", &k.dir);
    eprintln!("API server was down for {:?}", outage_started.elapsed());

    // Changes made right after the restart, while meshca's watch is still
    // backing off.
    k.delete_pod(&ns, "app-0").await;
    k.pod(&ns, "new-0", "newsa", "node-a").await;

    let n = ns.clone();
    srv.wait_index("changes after the restart", move |s| {
        s.get(&n, "app-0").is_none() && s.get(&n, "new-0").is_some()
    })
    .await;
    let chain = srv
        .call(&zt_token, &newsa, Some(&newsa), Some("Kubernetes"))
        .await
        .unwrap();
    assert_eq!(common::leaf_uri(&chain[0]), newsa);
    let r = srv
        .call(&zt_token, &app, Some(&app), Some("Kubernetes"))
        .await;
    assert_eq!(r.unwrap_err().code(), Code::Unauthenticated);
    assert_eq!(srv.last_reason().as_str(), "impersonation_no_pod_on_node");

    // The cold replica syncs and becomes ready.
    let deadline = Instant::now() + Duration::from_secs(90);
    while cold.readyz().await != 200 {
        assert!(Instant::now() < deadline, "cold replica never became ready");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cold.call(&zt_token, &newsa, Some(&newsa), Some("Kubernetes"))
        .await
        .unwrap();
}
