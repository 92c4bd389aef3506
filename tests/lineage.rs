//! Lineage and issuer at request time, without Kubernetes (real rustls on
//! 127.0.0.1): a client certificate of another CA under the same root is
//! no proof of this cluster, and revoking one serial of a renewal chain
//! refuses every renewal of it, those issued after the revocation's
//! snapshot included.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use meshca::ca::generate::KeyType;
use meshca::ca::CaBundle;
use meshca::testing::{self, TestPki};
use time::OffsetDateTime;

const ID: &str = "spiffe://cluster.local/ns/shop/sa/cart";

/// An mTLS CreateCertificate for [`ID`] with `cert` (chain PEM, key PEM):
/// the new (chain PEM, key PEM), or the status.
async fn renew(
    app: &meshca::app::App,
    root: &str,
    cert: &(String, String),
) -> Result<(String, String), tonic::Status> {
    let mut c = testing::client(app.addr, root, Some((&cert.0, &cert.1)))
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let key = rcgen::KeyPair::generate().unwrap();
    let chain = c
        .create_certificate(testing::request(testing::csr_for(&key, ID), 0, &[]))
        .await?
        .into_inner()
        .cert_chain;
    Ok((chain.concat(), key.serialize_pem()))
}

fn last_reason(sink: &meshca::audit::MemorySink) -> String {
    sink.records().last().unwrap().reason.clone()
}

/// Multi-primary with a shared root: a sibling cluster's CA (its own
/// intermediate under the same root) signs a leaf with an unmarked serial.
/// It passes the handshake (same root), but it is not this deployment's
/// leaf: refused `mtls_foreign_issuer`, never bound to the local cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_clusters_unmarked_leaf_is_not_taken_for_a_local_one() {
    let now = OffsetDateTime::now_utc();
    let pki = TestPki::new(KeyType::EcdsaP256);
    let sibling = testing::new_intermediate(&pki.ca, now);
    let sibling_dir = tempfile::tempdir().unwrap();
    meshca::ca::generate::write_cacerts(sibling_dir.path(), &sibling, false).unwrap();
    let theirs = CaBundle::load_dir(sibling_dir.path(), now).unwrap();
    let ours = CaBundle::load_dir(pki.path(), now).unwrap();
    let (app, sink) =
        testing::start_server(&testing::test_config(pki.path_buf()), Default::default()).await;
    let root = &pki.ca.root_cert;

    let mine = testing::client_identity(&ours, ID, &testing::validity_hours(-1, 1));
    renew(&app, root, &mine).await.unwrap();
    assert_eq!(last_reason(&sink), "issued");

    let foreign = testing::client_identity(&theirs, ID, &testing::validity_hours(-1, 1));
    let got = renew(&app, root, &foreign).await;
    let reason = last_reason(&sink);
    eprintln!(
        "sibling's unmarked leaf: {:?}, reason {reason}",
        got.as_ref().map(|_| "issued")
    );
    assert_eq!(
        got.map(|_| ()).map_err(|s| s.code()),
        Err(tonic::Code::Unauthenticated)
    );
    assert_eq!(reason, "mtls_foreign_issuer");
    app.shutdown().await.unwrap();
}

/// B0 (a client certificate) renews to L1, L1 to L2, L2 to L3, over mTLS.
/// Then L1 alone is revoked in the store the server reads: L3, issued
/// before and unknown to the revocation, and L2 are refused
/// `mtls_lineage_revoked`; a certificate of another lineage still renews.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_one_renewal_refuses_every_renewal_of_its_lineage() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("revoked-serials.jsonl");
    let mut cfg = testing::test_config(pki.path_buf());
    cfg.kill_switch.revocation = Some(meshca::revocation::RevocationSettings {
        file: Some(store.clone()),
        configmap: None,
        poll: Duration::from_millis(100),
        crl_validity: Duration::from_secs(3600),
        publish: None,
    });
    let (app, sink) = testing::start_server(&cfg, Default::default()).await;
    let root = &pki.ca.root_cert;
    let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
    let b0 = testing::client_identity(&bundle, ID, &testing::validity_hours(-1, 1));
    let l1 = renew(&app, root, &b0).await.unwrap();
    let l2 = renew(&app, root, &l1).await.unwrap();
    let l3 = renew(&app, root, &l2).await.unwrap();
    let other = testing::client_identity(&bundle, ID, &testing::validity_hours(-1, 1));

    let l1_serial = testing::leaf_serial(&l1.0);
    let entries = meshca::revocation::select(
        &[],
        &meshca::revocation::Target::Serials(vec![l1_serial]),
        "key-compromise",
        Some("test"),
        OffsetDateTime::now_utc(),
    );
    meshca::revocation::append_store(&store, &entries).unwrap();
    // In force once L1 itself is refused.
    let deadline = Instant::now() + Duration::from_secs(10);
    while renew(&app, root, &l1).await.is_ok() {
        assert!(Instant::now() < deadline, "revocation never took effect");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(last_reason(&sink), "mtls_cert_revoked");

    let mut refused = 0;
    for (name, cert) in [("L3", &l3), ("L2", &l2), ("B0", &b0)] {
        let got = renew(&app, root, cert).await;
        let reason = last_reason(&sink);
        eprintln!("{name} after revoking L1: {reason}");
        if got.is_err() && reason == "mtls_lineage_revoked" {
            refused += 1;
        }
    }
    eprintln!("renewals of the revoked lineage refused: {refused} of 3");
    assert_eq!(refused, 3, "every certificate of L1's lineage is refused");
    renew(&app, root, &other).await.unwrap();
    assert_eq!(last_reason(&sink), "issued", "another lineage renews");
    app.shutdown().await.unwrap();
}
