//! The admin HTTP port: liveness, readiness and Prometheus metrics. Nothing
//! here takes a lock the signing path uses: readiness reads atomics.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;

use std::sync::atomic::Ordering;

use rustls_pki_types::pem::PemObject;
use x509_parser::prelude::FromDer;

use crate::authn::token::KubeTokenAuthenticator;
use crate::ca::CaStore;
use crate::metrics::Snapshot;
use crate::podindex::accounts::AccountIndex;
use crate::podindex::PodIndex;
use crate::transport::metrics::TransportMetrics;
use crate::transport::{AdminLimits, ConnTracker, Pool, Refusal};

/// What `/metrics` serves: the Prometheus text exposition of every metric,
/// with the values read at scrape time.
pub trait Exposition: Send + Sync + std::fmt::Debug {
    fn render(&self, snap: &Snapshot, now_unix: i64) -> String;
}

/// What readiness depends on.
#[derive(Debug, Clone)]
pub struct Health {
    pub ca: Arc<CaStore>,
    /// The store of the CA directory's material (the same store as `ca`
    /// unless two-tier issuing serves leaves from an issuing CA).
    pub custody: Arc<CaStore>,
    /// Present when impersonation is served from a pod index.
    pub index: Option<Arc<PodIndex>>,
    /// The local cluster's ServiceAccount index, when it runs.
    pub accounts: Option<Arc<AccountIndex>>,
    pub metrics: Arc<dyn Exposition>,
    pub token_reviewer: Option<Arc<KubeTokenAuthenticator>>,
    /// The CRL in force, served at `/ca-crl.pem` when revocation is on.
    pub crl: Option<Arc<crate::revocation::LiveRevocations>>,
    /// The cluster registry: ready once the remote secrets are listed.
    pub clusters: Option<Arc<crate::cluster::ClusterRegistry>>,
    /// `MESHCA_POD_INDEX_MAX_STALENESS`, exported beside the watch's
    /// disconnection; past it a local index makes the server not ready.
    pub max_index_staleness: Duration,
}

impl Health {
    /// Ready when CA material is loaded and, with Kubernetes, the pod index
    /// has completed its first sync (istiod has no such gate) and neither
    /// local index has gone without evidence of freshness past the staleness
    /// bound (it vouches for nothing then: impersonation, bounded renewal
    /// and local token verification refuse). The error says why.
    pub fn readiness(&self) -> Result<(), Cow<'static, str>> {
        if time::OffsetDateTime::now_utc() >= self.ca.snapshot().signing_not_after() {
            return Err("signing certificate expired".into());
        }
        if self.crl.as_ref().is_some_and(|c| !c.is_loaded()) {
            return Err("revocations not loaded".into());
        }
        if self.index.as_ref().is_some_and(|i| !i.is_synced()) {
            return Err("pod index not synced".into());
        }
        let indexes = [
            ("pod", self.index.as_ref().map(|i| i.disconnected_for())),
            (
                "service account",
                self.accounts.as_ref().map(|a| a.disconnected_for()),
            ),
        ];
        for (what, disconnected) in indexes {
            if let Some(d) = disconnected
                .flatten()
                .filter(|d| *d > self.max_index_staleness)
            {
                return Err(format!(
                    "{what} index stale: no evidence its watch is current for {}s (max {}s)",
                    d.as_secs(),
                    self.max_index_staleness.as_secs()
                )
                .into());
            }
        }
        self.clusters
            .as_ref()
            .map_or(Ok(()), |c| c.readiness().map_err(Cow::Borrowed))
    }
}

async fn metrics_handler(
    State(h): State<Health>,
) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    if let Some(c) = &h.clusters {
        c.publish_sync();
    }
    let bundle = h.ca.snapshot();
    let snap = Snapshot {
        root_not_after: Some(bundle.root_not_after().unix_timestamp()),
        chain_not_after: bundle.chain_not_after().map(|t| t.unix_timestamp()),
        signing_not_after: Some(bundle.signing_not_after().unix_timestamp()),
        ca_not_after: Some(h.custody.snapshot().signing_not_after().unix_timestamp()),
        pod_index: h
            .index
            .as_ref()
            .map(|i| (i.len(), i.is_synced(), i.events_applied())),
        pod_index_watch: h.index.as_ref().map(|i| {
            (
                i.disconnected_for().unwrap_or_default().as_secs_f64(),
                h.max_index_staleness.as_secs_f64(),
            )
        }),
        crl: h.crl.as_ref().and_then(|c| crl_times(&c.crl_pem())),
        token_cache: h.token_reviewer.as_ref().map(|r| {
            (
                r.hits.load(Ordering::Relaxed),
                r.misses.load(Ordering::Relaxed),
            )
        }),
        ready: Some(h.readiness().is_ok()),
        process: crate::metrics::process::read(),
    };
    let body = h
        .metrics
        .render(&snap, time::OffsetDateTime::now_utc().unix_timestamp());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
}

/// thisUpdate and nextUpdate of the first CRL in `pem`: the current
/// signer's (CRLs of replaced issuing CAs follow it and end with them).
fn crl_times(pem: &str) -> Option<(i64, i64)> {
    let der = rustls_pki_types::CertificateRevocationListDer::pem_slice_iter(pem.as_bytes())
        .next()?
        .ok()?;
    let (_, crl) = x509_parser::revocation_list::CertificateRevocationList::from_der(&der).ok()?;
    let this_update = crl.last_update().timestamp();
    let next_update = crl.next_update()?.timestamp();
    Some((this_update, next_update))
}

/// The CRL signed by the issuing intermediate (what `istio-ca-crl` holds).
async fn crl_handler(State(h): State<Health>) -> (StatusCode, String) {
    match h.crl.as_ref().map(|c| c.crl_pem()) {
        Some(pem) if !pem.is_empty() => (StatusCode::OK, pem.to_string()),
        Some(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "no CRL signed yet\n".into(),
        ),
        None => (StatusCode::NOT_FOUND, "revocation is off\n".into()),
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(h): State<Health>) -> (StatusCode, String) {
    match h.readiness() {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

/// Binds the admin listener and serves it until the task is dropped. Each
/// connection must send its headers within `header_timeout` and is closed
/// after `connection_timeout` whatever it does; beyond `max_connections`
/// (or `max_connections_per_ip` from one source, so a few trickling IPs
/// cannot refuse kubelet's probes) new connections are closed at once.
/// (axum::serve has none of these.)
pub async fn bind(
    addr: SocketAddr,
    health: Health,
    limits: AdminLimits,
    metrics: Option<Arc<TransportMetrics>>,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_handler))
        .route("/ca-crl.pem", get(crl_handler))
        .with_state(health);
    let slots = ConnTracker::for_pool(
        Pool::Admin,
        limits.max_connections,
        limits.max_connections_per_ip,
        None,
    );
    let task = tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let refuse = |r: Refusal| {
                tracing::debug!(%peer, reason = r.reason(), "admin connection refused");
                if let Some(m) = &metrics {
                    m.refused(r);
                }
            };
            let slot = match slots.open(peer.ip()) {
                Ok(s) => s,
                Err(r) => {
                    refuse(r);
                    continue;
                }
            };
            let app = app.clone();
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let mut app = app.clone();
                    tower_service::Service::call(&mut app, req)
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(limits.header_timeout)
                    .serve_connection(TokioIo::new(tcp), service);
                if tokio::time::timeout(limits.connection_timeout, conn)
                    .await
                    .is_err()
                {
                    if let Some(m) = &metrics {
                        m.refused(Refusal::AdminTimeout);
                    }
                }
                drop(slot);
            });
        }
    });
    Ok((local, task))
}
