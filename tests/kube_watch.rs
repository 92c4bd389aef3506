//! A silent watch goes stale. The API server is paused with SIGSTOP
//! (`scripts/kube-testenv pause-apiserver`): its connections stay open and
//! say nothing, as in a partition or a hung API server, so no watch sees an
//! error. Within the staleness bound plus the watch's evidence bound, local
//! token verification refuses (or asks TokenReview, which cannot answer),
//! impersonation refuses, a cached TokenReview success is dropped, /readyz
//! says which index is stale, and the metric shows the age of the last
//! evidence. After SIGCONT every index recovers. Its own test binary: the
//! pause would stall any other test on this API server.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{client_cert, kte, spiffe, start, Ask, Server};
use meshca::authn::local::TokenVerificationMode;
use meshca::ca::generate::KeyType;
use meshca::testing::{http_get, TestPki};
use tonic::Code;

/// The staleness bound of every server here: its watches end every 3 s
/// (with a bookmark), and one silent for 6 s is started again.
const MAX: Duration = Duration::from_secs(9);
/// What "a few seconds" past the bound may take: the last evidence came up
/// to one watch period before the pause, and the checks poll.
const SLACK: Duration = Duration::from_secs(8);

/// Resumes the paused API server however the test ends.
struct Paused(PathBuf);

impl Paused {
    fn pause(dir: &Path) -> Self {
        common::kte_script("pause-apiserver", dir);
        Self(dir.to_path_buf())
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        // No panic here: this may run while a failed assertion unwinds.
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/kube-testenv");
        match std::process::Command::new(script)
            .arg("resume-apiserver")
            .arg(&self.0)
            .status()
        {
            Ok(s) if s.success() => {}
            other => eprintln!("kube-testenv resume-apiserver failed: {other:?}"),
        }
    }
}

async fn server(k: &common::Kte, mode: TokenVerificationMode, trusted: &[String]) -> Server {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let mut cfg = common::kube_config(&pki, k.meshca_kubeconfig(), trusted);
    cfg.kill_switch.renewal.max_index_staleness = MAX;
    cfg.kill_switch.renewal_pod_check = true;
    cfg.mtls_impersonation = true;
    let kube = cfg.kube.as_mut().unwrap();
    kube.token_verification.mode = mode;
    kube.token_cache_ttl = Duration::from_secs(600);
    kube.tokenreview_timeout = Duration::from_secs(1);
    let srv = start(cfg, pki).await;
    if mode.uses_local() {
        let keys = srv.app.issuer_keys.clone().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while keys.current().is_none() {
            assert!(Instant::now() < deadline, "issuer keys never loaded");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    srv
}

/// The value of the series of `name` whose labels contain every one of
/// `labels` in a Prometheus text scrape.
fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| labels.iter().all(|x| l.contains(x)))
        .and_then(|l| l.rsplit_once(' '))
        .and_then(|(_, v)| v.parse().ok())
}

async fn evidence_age(srv: &Server, index: &str) -> Option<f64> {
    let (_, text) = http_get(srv.app.admin_addr, "/metrics").await;
    sample(
        &text,
        "meshca_index_freshness_age_seconds",
        &[&format!("index=\"{index}\"")],
    )
}

/// (reason, detail) of the last request's audit record.
fn last(srv: &Server) -> (String, String) {
    let rec = srv.audit.requests().last().cloned().unwrap();
    (rec.reason, rec.detail.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_api_server_makes_the_indexes_stale_within_the_bound() {
    let k = kte().await;
    let zt_ns = k.namespace("zt").await;
    k.service_account(&zt_ns, "ztunnel").await;
    k.pod(&zt_ns, "ztunnel-a", "ztunnel", "node-a").await;
    k.set_pod_ip(&zt_ns, "ztunnel-a", "127.0.0.1").await;
    let ns = k.namespace("silent").await;
    k.service_account(&ns, "app").await;
    let uid = k.pod(&ns, "app-0", "app", "node-a").await;
    let token = k.token(&ns, "app", Some(("app-0", &uid)), "istio-ca").await;
    let app = spiffe(&ns, "app");
    let trusted = [format!("{zt_ns}/ztunnel")];

    let local = server(&k, TokenVerificationMode::Local, &trusted).await;
    let both = server(&k, TokenVerificationMode::LocalThenReview, &trusted).await;
    let review = server(&k, TokenVerificationMode::Review, &trusted).await;
    let zt_cert = client_cert(&local.pki, &spiffe(&zt_ns, "ztunnel"), 3600);
    let impersonate = || {
        let ask = Ask {
            cert: Some(&zt_cert),
            impersonate: Some(&app),
            cluster: Some("Kubernetes"),
            ..Default::default()
        };
        local.ask(&app, ask)
    };
    for srv in [&local, &both, &review] {
        let (n, z) = (ns.clone(), zt_ns.clone());
        srv.wait_index("pods", move |s| {
            s.get(&n, "app-0").is_some()
                && s.get(&z, "ztunnel-a")
                    .is_some_and(|p| !p.pod_ips.is_empty())
        })
        .await;
        // Allowed, and remembered by the review server's cache.
        srv.call(&token, &app, None, None).await.unwrap();
    }
    impersonate().await.0.unwrap();

    // A quiet, healthy API server: nothing changes, yet the indexes never
    // read as disconnected (their watches bring bookmarks), for twice the
    // silence bound.
    let quiet = Instant::now();
    let mut samples = 0;
    while quiet.elapsed() < Duration::from_secs(12) {
        for srv in [&local, &both, &review] {
            let index = srv.app.pod_index.clone().unwrap();
            assert_eq!(index.disconnected_for(), None, "healthy, quiet: stale");
        }
        samples += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(samples >= 40, "{samples}");
    assert_eq!(local.readyz().await, 200);

    let paused = Paused::pause(&k.dir);
    let t0 = Instant::now();
    // Served from the indexes at first (an outage shorter than the bound).
    local.call(&token, &app, None, None).await.unwrap();

    // Polled until every check holds, or the bound plus a few seconds.
    let deadline = t0 + MAX + SLACK;
    let mut first_refused = None;
    let mut seen: Vec<String>;
    let all_by = loop {
        let refused = local.call(&token, &app, None, None).await.is_err();
        if refused && first_refused.is_none() {
            first_refused = Some(t0.elapsed());
        }
        let token_stale = refused && last(&local).0 == "token_local_index_stale";
        let imp = impersonate().await.0;
        let imp_stale = imp.as_ref().is_err_and(|e| e.code() == Code::Unavailable)
            && local.last_reason() == "impersonation_index_stale";
        let (code, body) = http_get(local.app.admin_addr, "/readyz").await;
        let ready_says = code == 503 && body.contains("index stale");
        let age = evidence_age(&local, "pod").await;
        let metric = age.is_some_and(|a| a > MAX.as_secs_f64());
        seen = vec![
            format!("token refused as stale: {token_stale}"),
            format!("impersonation refused as stale: {imp_stale} ({imp:?})"),
            format!("/readyz {code} {body:?}"),
            format!("evidence age {age:?}"),
        ];
        if token_stale && imp_stale && ready_says && metric {
            break t0.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "not stale {:?} after the pause: {seen:?}",
            t0.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!(
        "paused: first refusal after {first_refused:?}, every check after {all_by:?}: {seen:?}"
    );
    // Local-then-review asks TokenReview, which cannot answer; the review
    // server's cached success is dropped and reviewed again, likewise. Each
    // server's indexes go stale by their own last evidence, within the same
    // bound.
    for srv in [&both, &review] {
        let r = loop {
            match srv.call(&token, &app, None, None).await {
                Err(r) => break r,
                Ok(_) => assert!(
                    Instant::now() < deadline,
                    "still allowed {:?} after the pause",
                    t0.elapsed()
                ),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(r.code(), Code::Unavailable);
        assert_eq!(last(srv).0, "authn_tokenreview_unavailable");
    }
    eprintln!(
        "both other servers refused {:?} after the pause",
        t0.elapsed()
    );
    let (_, detail) = last(&both);
    assert!(
        detail.contains("after local verification: token_local_index_stale"),
        "{detail}"
    );
    let (_, body) = http_get(local.app.admin_addr, "/readyz").await;
    assert!(body.contains("pod index stale"), "{body}");

    drop(paused);
    let resumed = Instant::now();
    let deadline = resumed + Duration::from_secs(60);
    loop {
        let ok = local.call(&token, &app, None, None).await.is_ok()
            && both.call(&token, &app, None, None).await.is_ok()
            && review.call(&token, &app, None, None).await.is_ok()
            && impersonate().await.0.is_ok()
            && local.readyz().await == 200
            && evidence_age(&local, "pod")
                .await
                .is_some_and(|a| a < MAX.as_secs_f64());
        if ok {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the indexes never recovered after the API server resumed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("recovered {:?} after the resume", resumed.elapsed());
}
