//! Adversarial suite against the real RELEASE binary under
//! `meshca serve --dev` with a file audit sink. Each test starts its own
//! server, runs one bounded attack from 127.0.0.2-5 while a well-behaved mTLS
//! client on 127.0.0.1 keeps requesting certificates, then asserts:
//! - the server's peak RSS stays under the chart's 256 MiB memory limit;
//! - the good client saw no error and its p99 stays under GOOD_P99_BOUND,
//!   on its own connection and on fresh connections (one a second);
//! - the server is alive and serving afterwards (fresh mTLS issue + /healthz);
//! - the audit log verifies end to end (`meshca audit verify --strict`) and
//!   no line exceeds the audit line cap;
//! - attack-specific bounds (see each test).
//!
//! Tests run one at a time (they measure one process's memory and share the
//! machine's two cores). Figures are printed as `FIGURES | ...` lines; run
//! `cargo test --release --test adversarial -- --nocapture` to see them
//! (docs/SECURITY.md records them).
#![allow(clippy::unwrap_used)]

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::attack::{
    self, attacker_ips, n, AttackStats, Figures, GoodClient, GoodIdentity, RssSampler, Server,
    GOOD_P99_BOUND, MEMORY_LIMIT_BYTES,
};
use tokio::io::AsyncWriteExt;
use tokio::task::JoinSet;

static SERIAL: Mutex<()> = Mutex::new(());

/// What an attack gets to aim at.
#[derive(Clone)]
struct Target {
    addr: SocketAddr,
    admin: SocketAddr,
    root_pem: String,
    good: GoodIdentity,
}

/// Runs `attack` against a fresh server with the good client running, checks
/// the common invariants and returns the attack's counters.
fn run<F, Fut>(name: &str, attack: F) -> Arc<AttackStats>
where
    F: FnOnce(Target) -> Fut,
    Fut: Future<Output = Arc<AttackStats>>,
{
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let nofile = attack::raise_nofile();
    assert!(
        nofile >= 8192,
        "RLIMIT_NOFILE is {nofile}: the attacks need at least 8192 (ulimit -n 65536)"
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        let mut server = Server::start(&[]).await;
        let target = Target {
            addr: server.addr,
            admin: server.admin,
            root_pem: server.root_pem(),
            good: GoodIdentity::from_server(&server),
        };
        let good = GoodClient::start(&server).await;
        let rss = RssSampler::start(&server);
        let started = Instant::now();
        let stats = attack(target).await;
        let elapsed = started.elapsed();
        server.assert_serving(&format!("after {name}")).await;
        let good = good.stop().await;
        let peak = rss.stop().await;
        let (_, hwm) = server.memory();
        let refusals = attack::refusals(server.admin).await;
        let line_cap = attack::audit_line_cap(&server.bin);
        let audit = server.stop_and_verify_audit().await;
        println!(
            "{}",
            Figures {
                attack: name,
                peak_rss: peak,
                hwm,
                good: &good,
                stats: &stats,
                audit: &audit,
                refusals: &refusals,
                elapsed,
            }
        );
        assert!(
            hwm < MEMORY_LIMIT_BYTES,
            "{name}: server RSS peaked at {} MiB, over the chart's 256 MiB limit",
            hwm >> 20
        );
        assert!(good.ok > 0, "{name}: the good client got no certificate");
        assert!(
            good.errors.is_empty(),
            "{name}: the good client saw {} error(s) in {} requests: {:?}",
            good.errors.len(),
            good.ok + good.errors.len(),
            &good.errors[..good.errors.len().min(5)]
        );
        assert!(
            good.p99() <= GOOD_P99_BOUND,
            "{name}: the good client's p99 is {:?} (bound {GOOD_P99_BOUND:?})",
            good.p99()
        );
        assert!(
            good.fresh_errors.is_empty(),
            "{name}: good requests on fresh connections failed {} time(s) ({} ok): {:?}",
            good.fresh_errors.len(),
            good.fresh_ok,
            &good.fresh_errors[..good.fresh_errors.len().min(5)]
        );
        assert!(
            good.fresh_p99() <= GOOD_P99_BOUND,
            "{name}: the good client's p99 on fresh connections is {:?} (bound {GOOD_P99_BOUND:?})",
            good.fresh_p99()
        );
        assert!(
            audit.longest_line <= line_cap,
            "{name}: an audit line of {} bytes exceeds the line cap of {line_cap}",
            audit.longest_line
        );
        stats
    })
}

/// Reference figures with no attack running.
#[test]
fn baseline_without_attack() {
    run("baseline (no attack)", |_| async {
        tokio::time::sleep(Duration::from_secs(4)).await;
        Arc::new(AttackStats::default())
    });
}

/// Thousands of TCP connections trickling a real ClientHello one byte every
/// 500 ms for 12 s, never finishing the handshake; a connection the server
/// closes is reopened after 100 ms (as a persistent attacker does), up to
/// 30,000 connection attempts in all.
/// Fresh good connections from 127.0.0.1 must get in throughout: the
/// attackers' four IPs hold at most their per-IP share of the handshake
/// slots.
#[test]
fn slowloris_tls_client_hello() {
    let stats = run(SLOWLORIS, slowloris);
    assert!(n(&stats.attempted) >= SLOWLORIS_CONNS);
}

const SLOWLORIS: &str = "slowloris: 3000 conns trickling a ClientHello, reconnecting";
const SLOWLORIS_CONNS: usize = 3000;

async fn slowloris(t: Target) -> Arc<AttackStats> {
    const CONNS: usize = SLOWLORIS_CONNS;
    const MAX_ATTEMPTS: usize = 30_000;
    const HOLD: Duration = Duration::from_secs(12);
    let stats = Arc::new(AttackStats::default());
    let hello: Arc<[u8]> = attack::client_hello(&attack::attacker_tls(&t.root_pem)).into();
    let deadline = Instant::now() + HOLD;
    let ips = attacker_ips();
    let mut tasks = JoinSet::new();
    for i in 0..CONNS {
        let (stats, hello, src) = (stats.clone(), hello.clone(), ips[i % ips.len()]);
        tasks.spawn(async move {
            while Instant::now() < deadline && n(&stats.attempted) < MAX_ATTEMPTS {
                AttackStats::inc(&stats.attempted);
                match attack::connect_from(src, t.addr, Duration::from_secs(3)).await {
                    None => AttackStats::inc(&stats.connect_failed),
                    Some(tcp) => {
                        AttackStats::inc(&stats.connected);
                        if attack::trickle(tcp, &hello, Duration::from_millis(500), deadline).await
                        {
                            AttackStats::inc(&stats.closed_by_server);
                        }
                    }
                }
                // A refused attacker comes back after a short pause.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        if i % 200 == 199 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    while tasks.join_next().await.is_some() {}
    stats
}

/// HTTP/2 streams (real TLS handshake, no client certificate) each declaring
/// a 4 MiB gRPC message and sending 32 KiB of it, never finishing: 10
/// connections x up to 1000 streams, held 8 s.
#[test]
fn stream_flood_declaring_4mib_messages() {
    let mut prefix = vec![0u8];
    prefix.extend_from_slice(&(4u32 * 1024 * 1024).to_be_bytes());
    prefix.extend_from_slice(&[0u8; 32 * 1024]);
    let body = Bytes::from(prefix);
    let stats = run(
        "stream flood: 10x1000 streams declaring 4 MiB, sending 32 KiB",
        |t| h2_flood(t, 10, 1000, Some(body), Duration::from_secs(8)),
    );
    assert!(n(&stats.tls_ok) > 0, "no attack connection completed TLS");
}

/// 10,000 concurrent unauthenticated streams (headers only, never ended)
/// over 10 connections, held 8 s. The good client's p99 stays bounded: the
/// attackers' IPs hold at most their per-IP share of the request slots.
#[test]
fn ten_thousand_unauthenticated_streams() {
    let stats = run(TEN_K, ten_k);
    assert!(n(&stats.tls_ok) > 0, "no attack connection completed TLS");
}

const TEN_K: &str = "10k unauthenticated streams: 10x1000 header-only";

async fn ten_k(t: Target) -> Arc<AttackStats> {
    h2_flood(t, 10, 1000, None, Duration::from_secs(8)).await
}

/// Opens `conns` TLS connections without a client certificate and up to
/// `streams` CreateCertificate streams on each, optionally sending `body`
/// without ending the stream; holds everything until `hold` has passed.
async fn h2_flood(
    t: Target,
    conns: usize,
    streams: usize,
    body: Option<Bytes>,
    hold: Duration,
) -> Arc<AttackStats> {
    let stats = Arc::new(AttackStats::default());
    let cfg = attack::attacker_tls(&t.root_pem);
    let deadline = Instant::now() + hold;
    let ips = attacker_ips();
    let mut tasks = JoinSet::new();
    for c in 0..conns {
        let (stats, cfg, body, src) =
            (stats.clone(), cfg.clone(), body.clone(), ips[c % ips.len()]);
        tasks.spawn(async move {
            let Some(tls) = attack::tls_from(src, t.addr, &cfg, &stats).await else {
                return;
            };
            let Ok((client, conn)) = h2::client::handshake(tls).await else {
                AttackStats::inc(&stats.closed_by_server);
                return;
            };
            let cs = stats.clone();
            let driver = tokio::spawn(async move {
                let _ = conn.await;
                if Instant::now() < deadline {
                    AttackStats::inc(&cs.closed_by_server);
                }
            });
            let mut held = JoinSet::new();
            // `ready()` on the one SendRequest (not a clone) waits until the
            // previous stream is really open, i.e. within the server's
            // SETTINGS_MAX_CONCURRENT_STREAMS; a clone would queue streams
            // client-side and never send them.
            let mut client = Some(client);
            for i in 0..streams {
                let Some(c) = client.take() else { break };
                let ready = tokio::time::timeout_at(
                    deadline.min(Instant::now() + Duration::from_secs(2)).into(),
                    c.ready(),
                )
                .await;
                let Ok(Ok(c)) = ready else {
                    stats
                        .streams_blocked
                        .fetch_add(streams - i, std::sync::atomic::Ordering::Relaxed);
                    break;
                };
                let c = client.insert(c);
                let Ok((resp, mut send)) = c.send_request(attack::grpc_head(t.addr), false) else {
                    stats
                        .streams_blocked
                        .fetch_add(streams - i, std::sync::atomic::Ordering::Relaxed);
                    break;
                };
                AttackStats::inc(&stats.streams_opened);
                if let Some(b) = &body {
                    let _ = send.send_data(b.clone(), false);
                }
                let s = stats.clone();
                held.spawn(async move {
                    if tokio::time::timeout_at(deadline.into(), resp).await.is_ok() {
                        AttackStats::inc(&s.streams_answered);
                    }
                    // Keep the stream open until the attack ends.
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

/// Oversized fields from an mTLS caller and from a caller with no client
/// certificate: 1 MB ImpersonatedIdentity (printable and control bytes),
/// 1 MB bearer tokens, a 1 MB clusterid header, 50,000 metadata keys, and the
/// same fields just under the transport limits. Every one of them must be
/// refused (those the server reads with InvalidArgument, Unauthenticated or
/// ResourceExhausted), and none may produce an oversized audit line.
#[test]
fn oversized_fields_1mb() {
    let stats = run(
        "1 MB fields: ImpersonatedIdentity, bearer, clusterid, 50k keys",
        |t| async move {
            let stats = Arc::new(AttackStats::default());
            let mb = 1 << 20;
            let mut mtls = t.good.client(t.addr).await.unwrap();
            let mut anon = meshca::testing::client(t.addr, &t.root_pem, None)
                .await
                .unwrap();
            let printable = "a".repeat(mb);
            let control = "\u{1}".repeat(mb);
            let bearer: tonic::metadata::MetadataValue<_> =
                format!("Bearer {printable}").parse().unwrap();
            let big_header: tonic::metadata::MetadataValue<_> = printable.parse().unwrap();
            let keys: Vec<(String, prost_types::Value)> = (0..50_000)
                .map(|i| (format!("k{i:06}"), meshca::testing::string_value("v")))
                .collect();
            let csr_req = t.good.request();
            let with_meta = |fields: Vec<(String, prost_types::Value)>| {
                let mut r = csr_req.clone();
                r.metadata = Some(prost_types::Struct {
                    fields: fields.into_iter().collect(),
                });
                r
            };
            let record = |what: &str,
                          r: Result<
                tonic::Response<meshca::proto::IstioCertificateResponse>,
                tonic::Status,
            >| {
                match r {
                    Ok(_) => {
                        AttackStats::inc(&stats.accepted);
                        eprintln!("ACCEPTED: {what}");
                    }
                    Err(s) => {
                        AttackStats::inc(&stats.refused);
                        eprintln!("refused {what}: {:?} {:.120}", s.code(), s.message());
                    }
                }
            };
            // A refusal of a field the server read must carry a precise code,
            // not a transport failure.
            let record_mid = |what: &str, r: Result<tonic::Response<_>, tonic::Status>| {
                if let Err(s) = &r {
                    if !matches!(
                        s.code(),
                        tonic::Code::InvalidArgument
                            | tonic::Code::Unauthenticated
                            | tonic::Code::ResourceExhausted
                    ) {
                        AttackStats::inc(&stats.imprecise_codes);
                        eprintln!("IMPRECISE: {what}: {:?} {:.120}", s.code(), s.message());
                    }
                }
                record(what, r);
            };
            for i in 0..10 {
                let s = if i % 2 == 0 { &printable } else { &control };
                let r = mtls
                    .create_certificate(with_meta(vec![(
                        "ImpersonatedIdentity".into(),
                        meshca::testing::string_value(s),
                    )]))
                    .await;
                record("mTLS 1 MB ImpersonatedIdentity", r);
            }
            for i in 0..10 {
                let mut req = tonic::Request::new(csr_req.clone());
                req.metadata_mut().insert("authorization", bearer.clone());
                let r = if i % 2 == 0 {
                    mtls.create_certificate(req).await
                } else {
                    anon.create_certificate(req).await
                };
                record("1 MB bearer token", r);
            }
            for _ in 0..4 {
                let mut req = tonic::Request::new(csr_req.clone());
                req.metadata_mut().insert("clusterid", big_header.clone());
                record("mTLS 1 MB clusterid", mtls.create_certificate(req).await);
            }
            for _ in 0..4 {
                record(
                    "mTLS 50,000 metadata keys",
                    mtls.create_certificate(with_meta(keys.clone())).await,
                );
            }
            // Just under the transport limits (32 KiB header list, 128 KiB
            // message), so the field bounds themselves and the audit record
            // of the refusal are exercised: 24 KiB bearer tokens, a 1 KiB
            // clusterid, a 64 KiB ImpersonatedIdentity, 1,000 metadata keys.
            let mid_bearer: tonic::metadata::MetadataValue<_> =
                format!("Bearer {}", "b".repeat(24 * 1024)).parse().unwrap();
            let mid_cluster: tonic::metadata::MetadataValue<_> = "c".repeat(1024).parse().unwrap();
            let few_keys: Vec<(String, prost_types::Value)> = keys[..1000].to_vec();
            for i in 0..4 {
                let mut req = tonic::Request::new(csr_req.clone());
                req.metadata_mut()
                    .insert("authorization", mid_bearer.clone());
                let r = if i % 2 == 0 {
                    mtls.create_certificate(req).await
                } else {
                    anon.create_certificate(req).await
                };
                record_mid("24 KiB bearer token", r);
                let mut req = tonic::Request::new(csr_req.clone());
                req.metadata_mut().insert("clusterid", mid_cluster.clone());
                record_mid("mTLS 1 KiB clusterid", mtls.create_certificate(req).await);
                let r = mtls
                    .create_certificate(with_meta(vec![(
                        "ImpersonatedIdentity".into(),
                        meshca::testing::string_value(&control[..64 * 1024]),
                    )]))
                    .await;
                record_mid("mTLS 64 KiB ImpersonatedIdentity", r);
                record_mid(
                    "mTLS 1,000 metadata keys",
                    mtls.create_certificate(with_meta(few_keys.clone())).await,
                );
            }
            stats
        },
    );
    assert_eq!(
        n(&stats.accepted),
        0,
        "a request with an oversized field was accepted (see ACCEPTED lines)"
    );
    assert_eq!(n(&stats.refused), 44);
    assert_eq!(
        n(&stats.imprecise_codes),
        0,
        "a field refusal carried an imprecise gRPC code (see IMPRECISE lines)"
    );
}

/// Garbage: 200 connections sending random bytes instead of a ClientHello,
/// and 100 TLS connections (no client certificate) sending random bytes,
/// random frames after the preface, a CONTINUATION flood (4 MiB, never
/// ending the header block) or a frame declaring 16 MiB. The server must
/// close every one of them within 10 s.
#[test]
fn garbage_instead_of_client_hello_and_h2_frames() {
    let stats = run(
        "garbage: 200 raw + 100 TLS garbage-frame conns",
        |t| async move {
            let stats = Arc::new(AttackStats::default());
            let deadline = Instant::now() + Duration::from_secs(10);
            let cfg = attack::attacker_tls(&t.root_pem);
            let ips = attacker_ips();
            let mut tasks = JoinSet::new();
            for i in 0..200 {
                let (stats, src) = (stats.clone(), ips[i % ips.len()]);
                tasks.spawn(async move {
                    AttackStats::inc(&stats.attempted);
                    let Some(mut tcp) =
                        attack::connect_from(src, t.addr, Duration::from_secs(3)).await
                    else {
                        AttackStats::inc(&stats.connect_failed);
                        return;
                    };
                    AttackStats::inc(&stats.connected);
                    let _ = tokio::time::timeout_at(
                        deadline.into(),
                        tcp.write_all(&attack::random(8 * 1024)),
                    )
                    .await;
                    if tokio::time::timeout_at(deadline.into(), attack::until_closed(&mut tcp))
                        .await
                        .is_ok()
                    {
                        AttackStats::inc(&stats.closed_by_server);
                    }
                });
            }
            for i in 0..100 {
                let (stats, cfg, src) = (stats.clone(), cfg.clone(), ips[i % ips.len()]);
                tasks.spawn(async move {
                    let Some(mut tls) = attack::tls_from(src, t.addr, &cfg, &stats).await else {
                        return;
                    };
                    let payload = garbage_h2(i % 4);
                    let _ = tokio::time::timeout_at(deadline.into(), tls.write_all(&payload)).await;
                    if tokio::time::timeout_at(deadline.into(), attack::until_closed(&mut tls))
                        .await
                        .is_ok()
                    {
                        AttackStats::inc(&stats.closed_by_server);
                    }
                });
            }
            while tasks.join_next().await.is_some() {}
            stats
        },
    );
    assert_eq!(
        n(&stats.closed_by_server),
        n(&stats.connected),
        "the server held {} garbage connection(s) open for 10 s",
        stats.held()
    );
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = len.to_be_bytes()[1..].to_vec();
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Garbage after a TLS handshake, by kind.
fn garbage_h2(kind: usize) -> Vec<u8> {
    let mut out = Vec::new();
    match kind {
        // Not even a preface.
        0 => out.extend(attack::random(64 * 1024)),
        // Preface, then random frames.
        1 => {
            out.extend_from_slice(PREFACE);
            out.extend(attack::random(64 * 1024));
        }
        // CONTINUATION flood: a header block that never ends.
        2 => {
            out.extend_from_slice(PREFACE);
            out.extend(frame(0x4, 0, 0, &[]));
            out.extend(frame(0x1, 0, 1, &attack::random(16 * 1024)));
            let junk = attack::random(16 * 1024);
            for _ in 0..256 {
                out.extend(frame(0x9, 0, 1, &junk));
            }
        }
        // A DATA frame declaring 16 MiB (over any max frame size).
        _ => {
            out.extend_from_slice(PREFACE);
            out.extend(frame(0x4, 0, 0, &[]));
            out.extend_from_slice(&[0xff, 0xff, 0xff, 0x0, 0x0, 0, 0, 0, 1]);
            out.extend(attack::random(64 * 1024));
        }
    }
    out
}

/// Rapid reset (CVE-2023-44487 style), on TLS connections without a client
/// certificate, for at most 4 s each: (a) open a CreateCertificate stream and
/// reset it at once (h2 counts these as pending-accept resets); (b) open
/// streams in batches of 50, let the server accept and start them (20 ms),
/// then reset them all, the variant h2's own counter does not see. The
/// server must cut off both connections before the attack ends.
#[test]
fn rapid_stream_open_and_reset() {
    let stats = run(
        "rapid reset: open+RST_STREAM, immediate and after accept",
        |t| async move {
            let stats = Arc::new(AttackStats::default());
            let cfg = attack::attacker_tls(&t.root_pem);
            for (phase, batch) in [("immediate", 1usize), ("after accept", 50)] {
                let started = Instant::now();
                let deadline = started + Duration::from_secs(4);
                let before = n(&stats.streams_opened);
                let cut = reset_flood(&t, &cfg, &stats, batch, 25_000, deadline).await;
                eprintln!(
                    "rapid reset ({phase}): {} streams in {:.2} s, connection cut by server: {cut}",
                    n(&stats.streams_opened) - before,
                    started.elapsed().as_secs_f64()
                );
            }
            stats
        },
    );
    assert_eq!(
        n(&stats.tls_ok),
        2,
        "an attack connection did not complete TLS"
    );
    assert_eq!(
        n(&stats.closed_by_server),
        2,
        "the server did not cut off every open-and-reset connection within 4 s"
    );
}

/// One connection opening `batch` streams at a time and resetting them, up
/// to `max` streams or `deadline`; returns whether the server closed it.
async fn reset_flood(
    t: &Target,
    cfg: &Arc<rustls::ClientConfig>,
    stats: &Arc<AttackStats>,
    batch: usize,
    max: usize,
    deadline: Instant,
) -> bool {
    let Some(tls) = attack::tls_from(attacker_ips()[0], t.addr, cfg, stats).await else {
        return false;
    };
    let Ok((client, conn)) = h2::client::handshake(tls).await else {
        AttackStats::inc(&stats.closed_by_server);
        return true;
    };
    let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let c = cut.clone();
    let driver = tokio::spawn(async move {
        let _ = conn.await;
        c.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let mut opened = 0;
    let mut client = Some(client);
    'outer: while opened < max && Instant::now() < deadline {
        let mut open = Vec::with_capacity(batch);
        for _ in 0..batch {
            let Some(c) = client.take() else {
                break 'outer;
            };
            let Ok(Ok(c)) = tokio::time::timeout(Duration::from_secs(2), c.ready()).await else {
                break 'outer;
            };
            let c = client.insert(c);
            let Ok((resp, send)) = c.send_request(attack::grpc_head(t.addr), false) else {
                break 'outer;
            };
            AttackStats::inc(&stats.streams_opened);
            opened += 1;
            open.push((resp, send));
        }
        if batch > 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for (_resp, mut send) in open {
            send.send_reset(h2::Reason::CANCEL);
        }
    }
    // Give a GOAWAY in flight a moment to arrive.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let was_cut = cut.load(std::sync::atomic::Ordering::Relaxed);
    if was_cut {
        AttackStats::inc(&stats.closed_by_server);
    }
    drop(client);
    driver.abort();
    was_cut
}

/// Admin-port slowloris: 500 connections trickling a request line and
/// headers (one byte every 500 ms, never ending the head) for 15 s, while
/// /healthz is probed every 500 ms on a fresh connection from 127.0.0.1.
/// Every probe must answer: the attackers' four IPs hold at most their
/// per-IP share of the admin connections.
#[test]
fn admin_port_slowloris() {
    let stats = run(ADMIN, admin_slowloris);
    assert!(n(&stats.connected) > 0, "no admin connection was made");
    assert_eq!(
        stats.held(),
        0,
        "{} of {} trickling admin connections were still held after 15 s",
        stats.held(),
        n(&stats.connected)
    );
    assert!(n(&stats.probes_ok) > 0, "no /healthz probe ran");
    assert_eq!(
        n(&stats.probes_failed),
        0,
        "/healthz failed {} of {} times during the attack",
        n(&stats.probes_failed),
        n(&stats.probes_failed) + n(&stats.probes_ok)
    );
}

const ADMIN: &str = "admin slowloris: 500 conns trickling a request head, 15 s";

async fn admin_slowloris(t: Target) -> Arc<AttackStats> {
    const CONNS: usize = 500;
    let stats = Arc::new(AttackStats::default());
    let deadline = Instant::now() + Duration::from_secs(15);
    let head: Arc<[u8]> = Arc::from(&b"GET /healthz HTTP/1.1\r\nHost: meshca\r\nX-Slow: "[..]);
    let ips = attacker_ips();
    let mut tasks = JoinSet::new();
    for i in 0..CONNS {
        let (stats, head, src) = (stats.clone(), head.clone(), ips[i % ips.len()]);
        tasks.spawn(async move {
            AttackStats::inc(&stats.attempted);
            match attack::connect_from(src, t.admin, Duration::from_secs(3)).await {
                None => AttackStats::inc(&stats.connect_failed),
                Some(tcp) => {
                    AttackStats::inc(&stats.connected);
                    if attack::trickle(tcp, &head, Duration::from_millis(500), deadline).await {
                        AttackStats::inc(&stats.closed_by_server);
                    }
                }
            }
        });
    }
    let s = stats.clone();
    tasks.spawn(async move {
        while Instant::now() < deadline {
            let r = tokio::time::timeout(
                Duration::from_secs(5),
                attack::try_http_get(t.admin, "/healthz"),
            )
            .await;
            if matches!(r, Ok(Some(200))) {
                AttackStats::inc(&s.probes_ok);
            } else {
                AttackStats::inc(&s.probes_failed);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    while tasks.join_next().await.is_some() {}
    stats
}

/// Unauthenticated streams from the authenticated caller's own address
/// (loopback puts both on 127.0.0.1, as a NAT or a shared node address
/// can): 100 TLS connections without a client certificate, up to 100
/// streams each sending 4 KiB of a declared 4 MiB message and never the
/// rest, held 5 s. In the same run, an authenticated mTLS client (its own
/// connection, same address) is measured with no attack (before and after,
/// 3 s each) and under it (3 s, from 1 s into the attack). It
/// must keep at least 80% of its no-attack rate with no request over 1 s,
/// fresh authenticated connections must all succeed, and no attacker stream
/// may stay open longer than the unauthenticated body timeout (2 s by
/// default) plus 1 s of slack.
#[test]
fn unauthenticated_stream_flood_from_the_authenticated_callers_address() {
    use common::flood;
    const PHASE: Duration = Duration::from_secs(3);
    const FRESH_EVERY: Duration = Duration::from_millis(250);
    const BODY_TIMEOUT: Duration = Duration::from_secs(2);
    const SLACK: Duration = Duration::from_secs(1);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let nofile = attack::raise_nofile();
    assert!(nofile >= 8192, "RLIMIT_NOFILE is {nofile}: need 8192");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let attack_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        let mut server = Server::start(&[]).await;
        let (addr, root) = (server.addr, server.root_pem());
        let id = GoodIdentity::from_server(&server);
        let mut client = flood::auth_client(&id, addr).await;
        let before = flood::auth_phase(&id, &mut client, addr, PHASE, FRESH_EVERY).await;
        // The attacker runs on its own thread, so the authenticated
        // client's task never waits behind its tasks in this runtime.
        let attack = attack_rt.spawn(flood::flood(
            addr,
            root.clone(),
            100,
            100,
            flood::declared_4mib_body(),
            PHASE + Duration::from_secs(2),
            BODY_TIMEOUT + SLACK,
        ));
        // The attack's streams are open before the measurement starts.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let under = flood::auth_phase(&id, &mut client, addr, PHASE, FRESH_EVERY).await;
        let stats = attack.await.unwrap();
        attack_rt.shutdown_background();
        // The no-attack reference is measured before and after, so that
        // load from elsewhere on the machine drifting does not count.
        let after = flood::auth_phase(&id, &mut client, addr, PHASE, FRESH_EVERY).await;
        server.assert_serving("after the same-address stream flood").await;
        let refusals = attack::refusals(server.admin).await;
        server.stop_and_verify_audit().await;
        let reference = (before.rate() + after.rate()) / 2.0;
        let ratio = under.rate() / reference.max(1e-9);
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let a = &stats.attack;
        println!(
            "FIGURES | same-address stream flood: 100x100 unauthenticated streams declaring 4 MiB, 4 KiB sent | authenticated client: no attack {} ok in {:.1} s ({:.0}/s, max {:.0} ms, {} err, fresh {} ok / {} err); under attack {} ok in {:.1} s ({:.0}/s, max {:.0} ms, {} err {:?}, fresh {} ok / {} err {:?}); no attack again {} ok in {:.1} s ({:.0}/s); ratio to the mean of both no-attack rates {:.2} | attack: {} tls, {} closed by server, streams {} opened / {} answered / {} open at end / {} open past {:?}, longest answered {:.0} ms, {} answered past it | server refusals {:?}",
            before.ok,
            before.elapsed.as_secs_f64(),
            before.rate(),
            ms(before.max_latency),
            before.errors.len(),
            before.fresh_ok,
            before.fresh_errors.len(),
            under.ok,
            under.elapsed.as_secs_f64(),
            under.rate(),
            ms(under.max_latency),
            under.errors.len(),
            &under.errors[..under.errors.len().min(3)],
            under.fresh_ok,
            under.fresh_errors.len(),
            &under.fresh_errors[..under.fresh_errors.len().min(3)],
            after.ok,
            after.elapsed.as_secs_f64(),
            after.rate(),
            ratio,
            n(&a.tls_ok),
            n(&a.closed_by_server),
            n(&a.streams_opened),
            n(&a.streams_answered),
            n(&stats.open_at_end),
            n(&stats.open_past_bound),
            BODY_TIMEOUT + SLACK,
            ms(stats.max_lifetime()),
            stats.answered_past(BODY_TIMEOUT + SLACK),
            refusals,
        );
        assert!(n(&a.streams_opened) > 0, "the attack opened no stream");
        assert!(before.errors.is_empty(), "no attack: {:?}", before.errors);
        assert!(
            ratio >= 0.8,
            "the authenticated client kept {ratio:.2} of its no-attack rate ({:.0}/s against {reference:.0}/s; bound 0.8)",
            under.rate(),
        );
        assert!(
            under.errors.is_empty(),
            "the authenticated client saw {} error(s): {:?}",
            under.errors.len(),
            &under.errors[..under.errors.len().min(5)]
        );
        assert!(
            under.max_latency <= Duration::from_secs(1),
            "the authenticated client stalled {:?} (bound 1 s)",
            under.max_latency
        );
        assert!(
            under.fresh_ok > 0 && under.fresh_errors.is_empty(),
            "fresh authenticated connections: {} ok, {} failed: {:?}",
            under.fresh_ok,
            under.fresh_errors.len(),
            &under.fresh_errors[..under.fresh_errors.len().min(5)]
        );
        assert_eq!(
            (
                n(&stats.open_past_bound),
                stats.answered_past(BODY_TIMEOUT + SLACK)
            ),
            (0, 0),
            "attacker streams outlived the body timeout ({BODY_TIMEOUT:?} + {SLACK:?}): (still open, answered later)"
        );
    });
}
