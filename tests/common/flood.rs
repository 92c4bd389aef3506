//! The same-address stream flood of tests/adversarial.rs
//! (`unauthenticated_stream_flood_from_the_authenticated_callers_address`):
//! TLS connections without a client certificate, each holding up to N
//! CreateCertificate streams whose body declares a message it never sends,
//! from the same source address as an authenticated mTLS client (loopback
//! puts both on 127.0.0.1, as a NAT or a shared node address can). Measures
//! the authenticated client's rate and stalls, fresh authenticated
//! connections, and how long the server leaves each attacker stream open.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::task::JoinSet;

use super::attack::{self, AttackStats, GoodIdentity};

/// The address both the attacker and the authenticated client use.
pub const SHARED: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// One authenticated request's own deadline (the held-out run's): a stall
/// this long is an error, not only a slow answer.
pub const AUTH_DEADLINE: Duration = Duration::from_secs(5);

/// What the authenticated client saw in one phase.
#[derive(Debug, Default, Clone)]
pub struct AuthPhase {
    pub ok: usize,
    pub errors: Vec<String>,
    /// Longest single request (ok or not).
    pub max_latency: Duration,
    pub elapsed: Duration,
    /// Requests on fresh connections (a new TLS handshake each).
    pub fresh_ok: usize,
    pub fresh_errors: Vec<String>,
}

impl AuthPhase {
    pub fn rate(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// The authenticated client's own connection.
pub type AuthClient =
    meshca::proto::istio_certificate_service_client::IstioCertificateServiceClient<
        tonic::transport::Channel,
    >;

/// Connects the authenticated client (before any attack) and warms it up.
pub async fn auth_client(id: &GoodIdentity, addr: SocketAddr) -> AuthClient {
    let mut client = id
        .client(addr)
        .await
        .expect("authenticated client connects");
    client
        .create_certificate(id.request())
        .await
        .expect("authenticated client's first request");
    client
}

/// Runs the authenticated client back to back on its own connection for
/// `dur`, and one fresh authenticated connection every `fresh_every`.
pub async fn auth_phase(
    id: &GoodIdentity,
    client: &mut AuthClient,
    addr: SocketAddr,
    dur: Duration,
    fresh_every: Duration,
) -> AuthPhase {
    let fresh = {
        let id = id.clone();
        tokio::spawn(async move {
            let end = Instant::now() + dur;
            let (mut ok, mut errors) = (0, Vec::new());
            while Instant::now() < end {
                let t = Instant::now();
                match tokio::time::timeout(AUTH_DEADLINE, id.fresh_request(addr)).await {
                    Ok(Ok(())) => ok += 1,
                    Ok(Err(e)) => errors.push(format!("{e:#} after {:?}", t.elapsed())),
                    Err(_) => errors.push(format!("timed out after {:?}", t.elapsed())),
                }
                tokio::time::sleep(fresh_every.saturating_sub(t.elapsed())).await;
            }
            (ok, errors)
        })
    };
    let mut p = AuthPhase::default();
    let start = Instant::now();
    while start.elapsed() < dur {
        let t = Instant::now();
        let r = tokio::time::timeout(AUTH_DEADLINE, client.create_certificate(id.request())).await;
        let el = t.elapsed();
        p.max_latency = p.max_latency.max(el);
        match r {
            Ok(Ok(resp)) if resp.get_ref().cert_chain.len() >= 2 => p.ok += 1,
            Ok(Ok(_)) => p.errors.push("short chain".into()),
            Ok(Err(e)) => p
                .errors
                .push(format!("{:?}: {} after {el:?}", e.code(), e.message())),
            Err(_) => p.errors.push(format!("DEADLINE_EXCEEDED after {el:?}")),
        }
    }
    p.elapsed = start.elapsed();
    let (fresh_ok, fresh_errors) = fresh.await.expect("fresh task");
    p.fresh_ok = fresh_ok;
    p.fresh_errors = fresh_errors;
    p
}

/// What the attacker saw of its streams.
#[derive(Debug, Default)]
pub struct FloodStats {
    pub attack: AttackStats,
    /// Streams the server answered or reset, with how long each was open.
    pub lifetimes: Mutex<Vec<Duration>>,
    /// Streams still open (no answer, no reset) when the attack ended.
    pub open_at_end: AtomicUsize,
    /// Of those, the ones opened more than the bound before the end.
    pub open_past_bound: AtomicUsize,
}

impl FloodStats {
    pub fn max_lifetime(&self) -> Duration {
        self.lifetimes
            .lock()
            .expect("lifetimes")
            .iter()
            .max()
            .copied()
            .unwrap_or_default()
    }
    /// Answered streams that were open longer than `bound`.
    pub fn answered_past(&self, bound: Duration) -> usize {
        self.lifetimes
            .lock()
            .expect("lifetimes")
            .iter()
            .filter(|l| **l > bound)
            .count()
    }
}

/// Pause before an attacker retries a refused connection.
const RETRY: Duration = Duration::from_millis(20);

/// The body every attacker stream sends: a gRPC prefix declaring a 4 MiB
/// message, then 4 KiB of it, and never the rest.
pub fn declared_4mib_body() -> Bytes {
    let mut b = vec![0u8];
    b.extend_from_slice(&(4u32 * 1024 * 1024).to_be_bytes());
    b.extend_from_slice(&[0u8; 4 * 1024]);
    Bytes::from(b)
}

/// `conns` TLS connections from [`SHARED`] without a client certificate,
/// each retried until it is in (or the attack ends) and opening up to `streams` streams (within the server's
/// SETTINGS_MAX_CONCURRENT_STREAMS) that send `body` and never end; every
/// stream is held until `hold` has passed. A stream the server has not
/// answered or reset by then, and that was opened more than `bound` before,
/// counts in `open_past_bound`.
pub async fn flood(
    addr: SocketAddr,
    root_pem: String,
    conns: usize,
    streams: usize,
    body: Bytes,
    hold: Duration,
    bound: Duration,
) -> Arc<FloodStats> {
    let stats = Arc::new(FloodStats::default());
    let cfg = attack::attacker_tls(&root_pem);
    let deadline = Instant::now() + hold;
    let mut tasks = JoinSet::new();
    for _ in 0..conns {
        let (stats, cfg, body) = (stats.clone(), cfg.clone(), body.clone());
        tasks.spawn(async move {
            // A refused handshake (the address's pending-handshake share)
            // is retried, as a persistent attacker does.
            let tls = loop {
                if let Some(tls) = attack::tls_from(SHARED, addr, &cfg, &stats.attack).await {
                    break tls;
                }
                if Instant::now() + RETRY >= deadline {
                    return;
                }
                tokio::time::sleep(RETRY).await;
            };
            let Ok((client, conn)) = h2::client::handshake(tls).await else {
                AttackStats::inc(&stats.attack.closed_by_server);
                return;
            };
            let driver = tokio::spawn(async move {
                let _ = conn.await;
            });
            let mut held = JoinSet::new();
            let mut client = Some(client);
            for i in 0..streams {
                let Some(c) = client.take() else { break };
                let ready = tokio::time::timeout_at(deadline.into(), c.ready()).await;
                let Ok(Ok(c)) = ready else {
                    stats
                        .attack
                        .streams_blocked
                        .fetch_add(streams - i, Ordering::Relaxed);
                    break;
                };
                let c = client.insert(c);
                let Ok((resp, mut send)) = c.send_request(attack::grpc_head(addr), false) else {
                    stats
                        .attack
                        .streams_blocked
                        .fetch_add(streams - i, Ordering::Relaxed);
                    break;
                };
                let opened = Instant::now();
                AttackStats::inc(&stats.attack.streams_opened);
                let _ = send.send_data(body.clone(), false);
                let s = stats.clone();
                held.spawn(async move {
                    match tokio::time::timeout_at(deadline.into(), resp).await {
                        Ok(_) => {
                            AttackStats::inc(&s.attack.streams_answered);
                            s.lifetimes
                                .lock()
                                .expect("lifetimes")
                                .push(opened.elapsed());
                        }
                        Err(_) => {
                            s.open_at_end.fetch_add(1, Ordering::Relaxed);
                            if opened.elapsed() > bound {
                                s.open_past_bound.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    tokio::time::sleep_until(deadline.into()).await;
                    drop(send);
                });
            }
            while held.join_next().await.is_some() {}
            drop(client);
            driver.abort();
        });
    }
    while tasks.join_next().await.is_some() {}
    stats
}
