//! The admin HTTP port: liveness, readiness and Prometheus metrics. Nothing
//! here takes a lock the signing path uses: readiness reads atomics.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;

use std::sync::atomic::Ordering;

use crate::authn::token::KubeTokenAuthenticator;
use crate::ca::CaStore;
use crate::metrics::{Metrics, Snapshot};
use crate::podindex::PodIndex;

/// What readiness depends on.
#[derive(Debug, Clone)]
pub struct Health {
    pub ca: Arc<CaStore>,
    /// Present when impersonation is served from a pod index.
    pub index: Option<Arc<PodIndex>>,
    pub metrics: Arc<Metrics>,
    pub token_reviewer: Option<Arc<KubeTokenAuthenticator>>,
}

impl Health {
    /// Ready when CA material is loaded and, with Kubernetes, the pod index
    /// has completed its first sync (istiod has no such gate).
    pub fn readiness(&self) -> Result<(), &'static str> {
        if time::OffsetDateTime::now_utc() >= self.ca.snapshot().signing_not_after() {
            return Err("signing certificate expired");
        }
        match &self.index {
            Some(i) if !i.is_synced() => Err("pod index not synced"),
            _ => Ok(()),
        }
    }
}

async fn metrics(State(h): State<Health>) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    let bundle = h.ca.snapshot();
    let snap = Snapshot {
        root_not_after: Some(bundle.root_not_after().unix_timestamp()),
        chain_not_after: bundle.chain_not_after().map(|t| t.unix_timestamp()),
        signing_not_after: Some(bundle.signing_not_after().unix_timestamp()),
        pod_index: h
            .index
            .as_ref()
            .map(|i| (i.len(), i.is_synced(), i.events_applied())),
        token_cache: h.token_reviewer.as_ref().map(|r| {
            (
                r.hits.load(Ordering::Relaxed),
                r.misses.load(Ordering::Relaxed),
            )
        }),
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

/// Binds the admin listener and serves it until the task is dropped.
pub async fn bind(
    addr: SocketAddr,
    health: Health,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(health);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "admin server stopped");
        }
    });
    Ok((local, task))
}
