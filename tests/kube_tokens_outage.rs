//! Local token verification through an API server outage: with a warm key
//! set and a synced pod index, token callers never seen before still get
//! certificates, forged tokens are still refused, and a failed key refresh
//! keeps the last good keys; once the watches have been down longer than
//! the staleness bound, tokens are refused retryably instead. Its own test binary so the outage cannot
//! disturb other tests (cargo runs test binaries one by one).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{kte, kte_script, spiffe, start};
use meshca::authn::local::TokenVerificationMode;
use meshca::ca::generate::KeyType;
use meshca::testing::TestPki;
use tonic::Code;

/// The staleness bound of the strict servers.
const STRICT: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_key_set_verifies_new_callers_through_an_api_server_outage() {
    let k = kte().await;
    let ns = k.namespace("out").await;
    k.service_account(&ns, "app").await;
    let id = spiffe(&ns, "app");
    let uid0 = k.pod(&ns, "p0", "app", "node-a").await;
    let uid1 = k.pod(&ns, "p1", "app", "node-a").await;
    let seen = k.token(&ns, "app", Some(("p0", &uid0)), "istio-ca").await;
    // Minted now, first presented during the outage.
    let unseen = k.token(&ns, "app", Some(("p1", &uid1)), "istio-ca").await;

    // A server in `mode`, warm (its indexes show both pods, `seen` was
    // verified), with the staleness bound `staleness` when given.
    let warm = |mode, staleness: Option<Duration>| {
        let (k, ns, id, seen) = (&k, ns.clone(), id.clone(), seen.clone());
        async move {
            let pki = TestPki::new(KeyType::EcdsaP256);
            let mut cfg = common::kube_config(&pki, k.meshca_kubeconfig(), &[]);
            let kube = cfg.kube.as_mut().unwrap();
            kube.token_verification.mode = mode;
            // Refresh as often as allowed, so the outage is felt by the key loop.
            kube.token_verification.refresh.min_interval = Duration::from_millis(200);
            if let Some(s) = staleness {
                cfg.kill_switch.renewal.max_index_staleness = s;
            }
            let srv = start(cfg, pki).await;
            srv.wait_index("pods", move |s| {
                s.get(&ns, "p0").is_some() && s.get(&ns, "p1").is_some()
            })
            .await;
            srv.call(&seen, &id, None, None).await.unwrap();
            srv
        }
    };
    let modes = [
        TokenVerificationMode::Local,
        TokenVerificationMode::LocalThenReview,
    ];
    let mut servers = Vec::new();
    for mode in modes {
        servers.push(warm(mode, None).await);
    }
    // The same modes with a short staleness bound: once the watches have been
    // down longer than it, the indexes vouch for nothing (a deleted pod would
    // still be in them), and no token is allowed on their word.
    let mut strict = Vec::new();
    for mode in modes {
        strict.push((mode, warm(mode, Some(STRICT)).await));
    }

    kte_script("stop-apiserver", &k.dir);
    let outage = Instant::now();
    let result = std::panic::AssertUnwindSafe(async {
        for srv in &servers {
            let keys = srv.app.issuer_keys.clone().unwrap();
            // A refresh during the outage fails and keeps the last good set.
            tokio::time::sleep(Duration::from_millis(250)).await;
            assert!(keys.refresh().await, "a fetch was attempted");
            assert_eq!(
                keys.last_error().map(|e| e.reason()),
                Some("jwks_fetch_failed")
            );
            assert!(keys.current().is_some(), "last good keys kept");
            for token in [&seen, &unseen] {
                srv.call(token, &id, None, None)
                    .await
                    .expect("verified locally while the API server is down");
                let rec = srv.audit.requests().last().cloned().unwrap();
                assert_eq!(rec.token_verified_by.as_deref(), Some("local"));
            }
            // Still no wrong allow: a forged claim under a real signature.
            let parts: Vec<&str> = unseen.split('.').collect();
            let forged = format!("{}.{}x.{}", parts[0], parts[1], parts[2]);
            let r = srv.call(&forged, &id, None, None).await;
            assert_eq!(r.unwrap_err().code(), Code::Unauthenticated);
        }
        let wait_until = outage + STRICT + Duration::from_millis(500);
        tokio::time::sleep(wait_until.saturating_duration_since(Instant::now())).await;
        for (mode, srv) in &strict {
            let index = srv.app.pod_index.clone().unwrap();
            assert!(
                index.disconnected_for().is_some_and(|d| d > STRICT),
                "{mode:?}: the pod watch noticed the outage"
            );
            let r = srv.call(&seen, &id, None, None).await;
            assert!(r.is_err(), "{mode:?}: allowed on a stale index");
            assert_eq!(
                r.unwrap_err().code(),
                Code::Unavailable,
                "{mode:?}: retryable"
            );
            let rec = srv.audit.requests().last().cloned().unwrap();
            match mode {
                TokenVerificationMode::Local => {
                    assert_eq!(rec.reason, "token_local_index_stale")
                }
                _ => {
                    // Sent to TokenReview, which cannot answer either.
                    assert_eq!(rec.reason, "authn_tokenreview_unavailable");
                    let detail = rec.detail.clone().unwrap_or_default();
                    assert!(
                        detail.contains("after local verification: token_local_index_stale"),
                        "{detail}"
                    );
                }
            }
        }
    });
    let outcome = futures::FutureExt::catch_unwind(result).await;
    eprintln!("API server was down for {:?}", outage.elapsed());
    kte_script("start-apiserver", &k.dir);
    if let Err(p) = outcome {
        std::panic::resume_unwind(p);
    }
    // Back: the key loop recovers.
    for srv in &servers {
        let keys = srv.app.issuer_keys.clone().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            keys.refresh().await;
            if keys.last_error().is_none() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "keys never refreshed after the outage"
            );
        }
    }
}
