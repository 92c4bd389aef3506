//! Against the real kube-apiserver, real mTLS on 127.0.0.1: revoking one
//! certificate stops every renewal of it, also those issued after the
//! revocation was decided, and a node denylist entry stops the mTLS
//! renewals of leaves first issued on that node. No second `revoke` run,
//! no audit log read.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{kte, spiffe, start, Ask, Server};
use meshca::ca::generate::KeyType;
use meshca::testing::TestPki;
use time::OffsetDateTime;

/// A CreateCertificate for `id` with `token` or `cert`: the new client
/// certificate (chain PEM, key PEM), or the status.
async fn ask(
    srv: &Server,
    id: &str,
    token: Option<&str>,
    cert: Option<&(String, String)>,
) -> Result<(String, String), tonic::Status> {
    let a = Ask {
        token,
        cert,
        ..Default::default()
    };
    let (chain, key) = srv.ask(id, a).await;
    Ok((chain?.concat(), key.serialize_pem()))
}

/// Waits until `probe` is refused with `reason` (a kill switch in force).
async fn until_refused<F, Fut>(srv: &Server, reason: &str, probe: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(String, String), tonic::Status>>,
{
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if probe().await.is_err() && srv.last_reason() == reason {
            return;
        }
        assert!(Instant::now() < deadline, "never refused with {reason}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A server with a revocation file and a denylist file (polled every
/// 100 ms), and a pod `app-0` of `sa` on `node`: (its token, its id, the
/// server, the revocation store, the denylist file, the temp dir).
async fn setup(
    sa: &str,
    node: &str,
) -> (
    String,
    String,
    Server,
    std::path::PathBuf,
    std::path::PathBuf,
    tempfile::TempDir,
) {
    let k = kte().await;
    let ns = k.namespace("lineage").await;
    let (_, token) = k.pod_token(&ns, sa, &format!("{sa}-0"), node).await;
    let pki = TestPki::new(KeyType::EcdsaP256);
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("revoked-serials.jsonl");
    let deny = dir.path().join("denylist");
    let mut cfg = common::kube_config(&pki, k.meshca_kubeconfig(), &[]);
    cfg.kill_switch.revocation = Some(meshca::revocation::RevocationSettings {
        file: Some(store.clone()),
        configmap: None,
        poll: Duration::from_millis(100),
        crl_validity: Duration::from_secs(3600),
        publish: None,
    });
    cfg.kill_switch.denylist = meshca::denylist::DenylistSettings {
        file: Some(deny.clone()),
        poll: Duration::from_millis(100),
        configmap: None,
    };
    let srv = start(cfg, pki).await;
    (token, spiffe(&ns, sa), srv, store, deny, dir)
}

#[tokio::test]
async fn revoking_a_leaf_refuses_renewals_issued_before_and_unknown_to_the_revocation() {
    let (token, app, srv, store, _deny, _dir) = setup("app", "node-a").await;
    // L0 on the pod's token; L1 and L2 renewed over mTLS, each with the last.
    let l0 = ask(&srv, &app, Some(&token), None).await.unwrap();
    let l1 = ask(&srv, &app, None, Some(&l0)).await.unwrap();
    let l2 = ask(&srv, &app, None, Some(&l1)).await.unwrap();
    assert_eq!(srv.last_reason(), "issued");
    // What the operator revokes: L0, whose copy was stolen. L2 was issued
    // before, and the revocation never names it.
    let l0_serial = meshca::testing::leaf_serial(&l0.0);
    let entries = meshca::revocation::select(
        &[],
        &meshca::revocation::Target::Serials(vec![l0_serial]),
        "key-compromise",
        Some("test"),
        OffsetDateTime::now_utc(),
    );
    meshca::revocation::append_store(&store, &entries).unwrap();
    until_refused(&srv, "mtls_cert_revoked", || {
        ask(&srv, &app, None, Some(&l0))
    })
    .await;
    let got = ask(&srv, &app, None, Some(&l2)).await;
    let reason = srv.last_reason();
    eprintln!("L2 after revoking L0: {reason}");
    assert!(got.is_err(), "L2 renewed after its lineage was revoked");
    assert_eq!(reason, "mtls_lineage_revoked");
    // The owner bootstraps again with its token: a new lineage, which renews.
    let fresh = ask(&srv, &app, Some(&token), None).await.unwrap();
    ask(&srv, &app, None, Some(&fresh)).await.unwrap();
    assert_eq!(srv.last_reason(), "issued");
}

#[tokio::test]
async fn a_node_denylist_entry_refuses_mtls_renewals_of_lineages_begun_on_it() {
    let (token, web, srv, _store, deny, _dir) = setup("web", "node-b").await;
    // M0 on the token of a pod on node-b, M1 renewed from it over mTLS.
    let m0 = ask(&srv, &web, Some(&token), None).await.unwrap();
    let m1 = ask(&srv, &web, None, Some(&m0)).await.unwrap();
    // A lineage begun without a node (a client certificate) is untouched.
    let other = common::client_cert(&srv.pki, &web, 3600);
    let o1 = ask(&srv, &web, None, Some(&other)).await.unwrap();
    std::fs::write(&deny, "node node-b\n").unwrap();
    until_refused(&srv, "denylist_node", || {
        ask(&srv, &web, Some(&token), None)
    })
    .await;
    let got = ask(&srv, &web, None, Some(&m1)).await;
    let reason = srv.last_reason();
    eprintln!("M1 after denylisting node-b: {reason}");
    assert!(got.is_err(), "a renewal of node-b's lineage was issued");
    assert_eq!(reason, "denylist_origin_node");
    ask(&srv, &web, None, Some(&o1)).await.unwrap();
    assert_eq!(srv.last_reason(), "issued");
}
