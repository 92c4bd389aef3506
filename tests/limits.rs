//! Transport and input limits against a real server on 127.0.0.1:0 (real
//! rustls handshakes, real HTTP/2), each case bounded to a few connections
//! and a few seconds. The attack suite at scale is tests/adversarial.rs.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshca::app::{App, Deps};
use meshca::audit::MemorySink;
use meshca::ca::generate::KeyType;
use meshca::config::Config;
use meshca::grpc::IMPERSONATED_IDENTITY;
use meshca::testing::{
    self, client, client_identity, csr_for, request, string_value, validity_hours, TestPki,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::Code;

const CLIENT_ID: &str = "spiffe://cluster.local/ns/default/sa/client";

struct Server {
    app: App,
    audit: Arc<MemorySink>,
    pki: TestPki,
}

async fn start(tune: impl FnOnce(&mut Config)) -> Server {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let mut cfg = testing::test_config(pki.path_buf());
    tune(&mut cfg);
    let (app, audit) = testing::start_server(&cfg, Deps::default()).await;
    Server { app, audit, pki }
}

impl Server {
    async fn mtls_client(
        &self,
    ) -> meshca::proto::istio_certificate_service_client::IstioCertificateServiceClient<
        tonic::transport::Channel,
    > {
        let (cert, key) =
            client_identity(&self.app.ca.snapshot(), CLIENT_ID, &validity_hours(-1, 1));
        client(self.app.addr, &self.pki.ca.root_cert, Some((&cert, &key)))
            .await
            .unwrap()
    }

    async fn metrics(&self) -> String {
        testing::http_get(self.app.admin_addr, "/metrics").await.1
    }

    async fn refusals(&self, reason: &str) -> u64 {
        let line = format!("meshca_transport_refusals_total{{reason=\"{reason}\"}} ");
        self.metrics()
            .await
            .lines()
            .find_map(|l| l.strip_prefix(&line).map(|v| v.parse().unwrap()))
            .unwrap_or_else(|| panic!("no metric for {reason}"))
    }

    /// A TLS client config trusting the server, speaking h2, no client certificate.
    fn tls(&self) -> tokio_rustls::TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pki_types::CertificateDer::pem_slice_iter(self.pki.ca.root_cert.as_bytes())
        {
            roots.add(c.unwrap()).unwrap();
        }
        let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        tokio_rustls::TlsConnector::from(Arc::new(cfg))
    }

    /// An HTTP/2 connection with the client certificate of `CLIENT_ID`.
    async fn mtls_h2(
        &self,
    ) -> (
        h2::client::SendRequest<bytes::Bytes>,
        tokio::task::JoinHandle<Result<(), h2::Error>>,
    ) {
        let (cert, key) =
            client_identity(&self.app.ca.snapshot(), CLIENT_ID, &validity_hours(-1, 1));
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pki_types::CertificateDer::pem_slice_iter(self.pki.ca.root_cert.as_bytes())
        {
            roots.add(c.unwrap()).unwrap();
        }
        let chain = rustls_pki_types::CertificateDer::pem_slice_iter(cert.as_bytes())
            .map(|c| c.unwrap())
            .collect();
        let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
        let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        let tcp = TcpStream::connect(self.app.addr).await.unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect("localhost".try_into().unwrap(), tcp)
            .await
            .unwrap();
        let (send, conn) = h2::client::handshake(tls).await.unwrap();
        (send, tokio::spawn(conn))
    }

    /// An HTTP/2 connection without a client certificate.
    async fn h2(
        &self,
    ) -> (
        h2::client::SendRequest<bytes::Bytes>,
        tokio::task::JoinHandle<Result<(), h2::Error>>,
    ) {
        let tcp = TcpStream::connect(self.app.addr).await.unwrap();
        let tls = self
            .tls()
            .connect("localhost".try_into().unwrap(), tcp)
            .await
            .unwrap();
        let (send, conn) = h2::client::handshake(tls).await.unwrap();
        (send, tokio::spawn(conn))
    }
}

use rustls_pki_types::pem::PemObject;

/// Starts a CreateCertificate stream whose message declares 1000 bytes and
/// sends 10: the server is left waiting for the rest.
fn stuck_request(
    send: &mut h2::client::SendRequest<bytes::Bytes>,
) -> (h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>) {
    try_stuck_request(send).unwrap()
}

fn try_stuck_request(
    send: &mut h2::client::SendRequest<bytes::Bytes>,
) -> Result<(h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>), h2::Error> {
    let req = http::Request::post(
        "https://localhost/istio.v1.auth.IstioCertificateService/CreateCertificate",
    )
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap();
    let (resp, mut body) = send.send_request(req, false)?;
    let mut frame = vec![0u8, 0, 0, 0x03, 0xe8];
    frame.extend_from_slice(&[0x0a; 10]);
    body.send_data(frame.into(), false)?;
    Ok((resp, body))
}

/// The grpc-status of a response (trailers-only, or in the trailers).
async fn grpc_status(resp: h2::client::ResponseFuture) -> Option<String> {
    let resp = resp.await.ok()?;
    if let Some(s) = resp.headers().get("grpc-status") {
        return Some(s.to_str().unwrap().to_string());
    }
    let mut body = resp.into_body();
    while let Some(d) = body.data().await {
        d.ok()?;
    }
    let trailers = body.trailers().await.ok()??;
    Some(trailers.get("grpc-status")?.to_str().unwrap().to_string())
}

/// Whether the server closes `s` within `within` (EOF or reset on read).
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 64];
    loop {
        match tokio::time::timeout(within, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

#[tokio::test]
async fn an_oversized_impersonated_identity_is_refused_and_not_recorded() {
    let s = start(|_| {}).await;
    let mut c = s.mtls_client().await;
    let csr = csr_for(&rcgen::KeyPair::generate().unwrap(), CLIENT_ID);
    // 100 KB fits the message limit: refused by the field limit.
    let big = "x".repeat(100_000);
    let err = c
        .create_certificate(request(
            csr.clone(),
            0,
            &[(IMPERSONATED_IDENTITY, string_value(&big))],
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().len() < 200, "{}", err.message());
    let records = s.audit.requests();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].reason, "impersonated_identity_too_large");
    let line = serde_json::to_string(&records[0]).unwrap();
    assert!(line.len() < 2048, "audit record of {} bytes", line.len());
    assert!(!line.contains("xxxxxxxx"));

    // 1 MB is over the message limit: refused before decoding, as grpc-go does.
    let huge = "x".repeat(1_000_000);
    let err = c
        .create_certificate(request(
            csr.clone(),
            0,
            &[(IMPERSONATED_IDENTITY, string_value(&huge))],
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert_eq!(s.refusals("message_too_large").await, 1);
    // The same connection still gets certificates.
    c.create_certificate(request(csr, 0, &[])).await.unwrap();
}

#[tokio::test]
async fn an_oversized_bearer_token_or_clusterid_is_unauthenticated() {
    let s = start(|_| {}).await;
    let (send, _conn) = s.h2().await;
    for (header, value, reason) in [
        (
            "authorization",
            format!("Bearer {}", "t".repeat(20 * 1024)),
            "authn_token_too_large",
        ),
        ("clusterid", "c".repeat(1024), "authn_clusterid_too_large"),
    ] {
        let mut send = send.clone().ready().await.unwrap();
        let req = http::Request::post(
            "https://localhost/istio.v1.auth.IstioCertificateService/CreateCertificate",
        )
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header(header, value)
        .body(())
        .unwrap();
        let (resp, mut body) = send.send_request(req, false).unwrap();
        body.send_data(vec![0u8, 0, 0, 0, 0].into(), true).unwrap();
        // 16 = UNAUTHENTICATED
        assert_eq!(grpc_status(resp).await.as_deref(), Some("16"), "{reason}");
        assert_eq!(s.audit.requests().last().unwrap().reason, reason);
    }
}

#[tokio::test]
async fn connections_beyond_the_caps_are_closed_at_once() {
    // Global cap.
    let s = start(|c| {
        c.transport.max_connections = 2;
        c.transport.handshake_timeout = Duration::from_secs(30);
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(TcpStream::connect(s.app.addr).await.unwrap());
    }
    let mut third = TcpStream::connect(s.app.addr).await.unwrap();
    assert!(closed_within(&mut third, Duration::from_secs(2)).await);
    assert!(!closed_within(&mut held[0], Duration::from_millis(300)).await);
    assert_eq!(s.refusals("connection_limit").await, 1);
    // Closing one frees its place.
    held.pop();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut c = s.mtls_client().await;
    let csr = csr_for(&rcgen::KeyPair::generate().unwrap(), CLIENT_ID);
    c.create_certificate(request(csr, 0, &[])).await.unwrap();

    // Per-IP cap, for each class apart once the handshake tells it: a
    // second connection without a client certificate from the address is
    // closed, while an authenticated one from the same address gets in.
    let s = start(|c| c.transport.max_connections_per_ip = 1).await;
    let (_held, _held_conn) = s.h2().await;
    let tcp = TcpStream::connect(s.app.addr).await.unwrap();
    let mut second = s
        .tls()
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(Duration::from_secs(2), second.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "second unauthenticated connection still open: {closed:?}"
    );
    assert_eq!(s.refusals("connection_limit_per_ip").await, 1);
    let mut c = s.mtls_client().await;
    let csr = csr_for(&rcgen::KeyPair::generate().unwrap(), CLIENT_ID);
    c.create_certificate(request(csr, 0, &[])).await.unwrap();
    assert_eq!(s.refusals("connection_limit_per_ip").await, 1);
}

/// A stream without a client certificate that declares a message and never
/// sends it is reset after the unauthenticated body timeout, counted and
/// folded as `unauthenticated_body_timeout`; the same stream on an mTLS
/// connection is bounded by the request timeout only.
#[tokio::test]
async fn an_unauthenticated_stream_waiting_for_its_message_is_reset_after_the_body_timeout() {
    let s = start(|c| {
        c.transport.unauthenticated_body_timeout = Duration::from_millis(500);
        c.transport.request_timeout = Duration::from_secs(10);
    })
    .await;
    let (send, _conn) = s.h2().await;
    let mut send = send.ready().await.unwrap();
    let t = Instant::now();
    let (unauthenticated, _b1) = stuck_request(&mut send);
    let (msend, _mconn) = s.mtls_h2().await;
    let mut msend = msend.ready().await.unwrap();
    let (authenticated, _b2) = stuck_request(&mut msend);
    // 8 = RESOURCE_EXHAUSTED (with a retry hint), after the body timeout.
    assert_eq!(grpc_status(unauthenticated).await.as_deref(), Some("8"));
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(2),
        "{took:?}"
    );
    assert_eq!(s.refusals("unauthenticated_body_timeout").await, 1);
    // The authenticated stream is still waiting a second later.
    let waited = tokio::time::timeout(Duration::from_secs(1), grpc_status(authenticated)).await;
    assert!(waited.is_err(), "the mTLS stream was answered: {waited:?}");
    assert_eq!(s.refusals("unauthenticated_body_timeout").await, 1);
    // A caller without a certificate that sends its message in time is
    // read and answered (refused: it has no credentials).
    let mut c = client(s.app.addr, &s.pki.ca.root_cert, None).await.unwrap();
    let csr = csr_for(&rcgen::KeyPair::generate().unwrap(), CLIENT_ID);
    let r = c.create_certificate(request(csr, 0, &[])).await;
    assert_eq!(r.unwrap_err().code(), Code::Unauthenticated);
    assert_eq!(s.refusals("unauthenticated_body_timeout").await, 1);
}

#[tokio::test]
async fn handshakes_are_bounded_in_number_and_time() {
    let s = start(|c| {
        c.transport.max_pending_handshakes = 2;
        c.transport.handshake_timeout = Duration::from_secs(1);
    })
    .await;
    let start = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(TcpStream::connect(s.app.addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut third = TcpStream::connect(s.app.addr).await.unwrap();
    assert!(closed_within(&mut third, Duration::from_millis(500)).await);
    assert_eq!(s.refusals("handshake_limit").await, 1);
    for c in &mut silent {
        assert!(closed_within(c, Duration::from_secs(3)).await);
    }
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(s.refusals("handshake_timeout").await, 2);
    // A failed handshake (not TLS at all) is counted too.
    let mut junk = TcpStream::connect(s.app.addr).await.unwrap();
    junk.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    assert!(closed_within(&mut junk, Duration::from_secs(2)).await);
    assert_eq!(s.refusals("handshake_failed").await, 1);
    // A client that completes TLS but never sends the HTTP/2 preface is closed too.
    let t = Instant::now();
    let tcp = TcpStream::connect(s.app.addr).await.unwrap();
    let mut tls = s
        .tls()
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            match tls.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => continue,
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "silent TLS connection still open after 3 s");
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(s.refusals("handshake_timeout").await, 3);
}

#[tokio::test]
async fn requests_are_queued_bounded_and_timed_out() {
    let s = start(|c| {
        c.transport.max_inflight_requests = 1;
        c.transport.max_queued_requests = 1;
        c.transport.request_timeout = Duration::from_secs(1);
        // The stuck streams below are bounded by the request timeout.
        c.transport.unauthenticated_body_timeout = Duration::ZERO;
    })
    .await;
    let (send, _conn) = s.h2().await;
    let mut send = send.ready().await.unwrap();
    let (running, _b1) = stuck_request(&mut send);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut send = send.ready().await.unwrap();
    let (queued, _b2) = stuck_request(&mut send);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut send = send.ready().await.unwrap();
    let (refused, _b3) = stuck_request(&mut send);
    let t = Instant::now();
    // 8 = RESOURCE_EXHAUSTED, at once.
    assert_eq!(grpc_status(refused).await.as_deref(), Some("8"));
    assert!(t.elapsed() < Duration::from_millis(500));
    // The server's SETTINGS have arrived by now.
    assert_eq!(
        send.current_max_send_streams(),
        100,
        "MAX_CONCURRENT_STREAMS advertised"
    );
    // 4 = DEADLINE_EXCEEDED, after the request timeout.
    assert_eq!(grpc_status(running).await.as_deref(), Some("4"));
    assert_eq!(grpc_status(queued).await.as_deref(), Some("4"));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert_eq!(s.refusals("request_queue_full").await, 1);
    assert_eq!(s.refusals("request_timeout").await, 2);
    // Slots are free again.
    let mut c = s.mtls_client().await;
    let csr = csr_for(&rcgen::KeyPair::generate().unwrap(), CLIENT_ID);
    c.create_certificate(request(csr, 0, &[])).await.unwrap();
}

#[tokio::test]
async fn a_connection_past_its_age_and_grace_is_closed_even_with_a_stuck_stream() {
    let s = start(|c| {
        c.transport.max_connection_age = Duration::from_secs(1);
        c.transport.max_connection_age_grace = Duration::from_secs(1);
        c.transport.request_timeout = Duration::from_secs(60);
        c.transport.unauthenticated_body_timeout = Duration::ZERO;
    })
    .await;
    let t = Instant::now();
    let (send, conn) = s.h2().await;
    let mut send = send.ready().await.unwrap();
    let (_resp, _body) = stuck_request(&mut send);
    let ended = tokio::time::timeout(Duration::from_secs(5), conn).await;
    assert!(ended.is_ok(), "connection still open after 5 s");
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(1900),
        "closed too early: {took:?}"
    );
}

#[tokio::test]
async fn the_admin_port_times_out_slow_requests_and_caps_connections() {
    let s = start(|c| {
        c.admin.header_timeout = Duration::from_secs(1);
        c.admin.connection_timeout = Duration::from_secs(3);
        c.admin.max_connections = 2;
    })
    .await;
    let admin: SocketAddr = s.app.admin_addr;
    let t = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..2 {
        let mut c = TcpStream::connect(admin).await.unwrap();
        c.write_all(b"GET /heal").await.unwrap();
        slow.push(c);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut third = TcpStream::connect(admin).await.unwrap();
    assert!(closed_within(&mut third, Duration::from_millis(500)).await);
    for c in &mut slow {
        assert!(closed_within(c, Duration::from_secs(3)).await);
    }
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, body) = testing::http_get(admin, "/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    assert_eq!(s.refusals("admin_connection_limit").await, 1);
}

#[test]
fn the_binary_refuses_a_ttl_beyond_the_time_range_at_startup() {
    let dir = tempfile::tempdir().unwrap();
    for (flag, env) in [
        (Some(["--max-ttl", "1000000000h"]), None),
        (None, Some(("MAX_WORKLOAD_CERT_TTL", "1000000000h"))),
        (Some(["--handshake-timeout", "0s"]), None),
    ] {
        let mut cmd = meshca::testing::serve_dev_std_command(
            env!("CARGO_BIN_EXE_meshca").as_ref(),
            dir.path(),
        );
        if let Some(f) = flag {
            cmd.args(f);
        }
        if let Some((k, v)) = env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "started with {flag:?} {env:?}");
        let name = env.map(|e| e.0).unwrap_or_else(|| {
            if flag.unwrap()[0] == "--max-ttl" {
                "MAX_WORKLOAD_CERT_TTL"
            } else {
                "MESHCA_HANDSHAKE_TIMEOUT"
            }
        });
        assert!(stderr.contains(name), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[tokio::test]
async fn a_connection_that_cancels_streams_in_a_flood_is_closed() {
    let s = start(|c| c.transport.max_cancelled_streams_per_sec = 5).await;
    let (send, conn) = s.h2().await;
    let mut send = send;
    let mut sent = 0;
    for _ in 0..20 {
        let Ok(ready) = send.clone().ready().await else {
            break;
        };
        send = ready;
        let Ok((_resp, mut body)) = try_stuck_request(&mut send) else {
            break;
        };
        // Let the server start handling it, then cancel, as the flood did.
        tokio::time::sleep(Duration::from_millis(20)).await;
        body.send_reset(h2::Reason::CANCEL);
        sent += 1;
    }
    let ended = tokio::time::timeout(Duration::from_secs(2), conn).await;
    assert!(
        ended.is_ok(),
        "connection still open after {sent} cancelled streams"
    );
    assert!(sent < 20, "all {sent} streams were accepted");
    assert_eq!(s.refusals("stream_reset_flood").await, 1);
    // Other connections are unaffected, and finished requests (allowed or
    // denied) never count as cancelled.
    let mut c = s.mtls_client().await;
    for i in 0..20 {
        let id = if i % 2 == 0 {
            CLIENT_ID
        } else {
            "spiffe://cluster.local/ns/x/sa/y"
        };
        let csr = csr_for(&rcgen::KeyPair::generate().unwrap(), id);
        let r = c.create_certificate(request(csr, 0, &[])).await;
        assert_eq!(r.is_ok(), i % 2 == 0, "{r:?}");
    }
    assert_eq!(s.refusals("stream_reset_flood").await, 1);
}

/// A TCP connection from `src` (a 127.0.0.0/8 address) to `dst`.
async fn connect_from(src: &str, dst: SocketAddr) -> TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(SocketAddr::new(src.parse().unwrap(), 0)).unwrap();
    sock.connect(dst).await.unwrap()
}

/// Per-source fairness: one source IP at its handshake, request and admin
/// caps is refused (or queued) with its own reason, while a client from
/// another IP is served at once.
#[tokio::test]
async fn one_source_cannot_take_every_slot() {
    let s = start(|c| {
        c.transport.max_pending_handshakes_per_ip = 1;
        c.transport.max_inflight_requests_per_ip = 1;
        c.transport.max_queued_requests = 1;
        c.transport.request_timeout = Duration::from_secs(2);
        c.transport.unauthenticated_body_timeout = Duration::ZERO;
        c.admin.max_connections_per_ip = 1;
    })
    .await;
    let csr = || csr_for(&rcgen::KeyPair::generate().unwrap(), CLIENT_ID);

    // Handshakes: a silent connection from 127.0.0.2 holds its source's one
    // slot; a second from it is closed, one from 127.0.0.1 is served.
    let silent = connect_from("127.0.0.2", s.app.addr).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut second = connect_from("127.0.0.2", s.app.addr).await;
    assert!(closed_within(&mut second, Duration::from_millis(500)).await);
    assert_eq!(s.refusals("handshake_limit_per_ip").await, 1);
    let mut good = s.mtls_client().await;
    good.create_certificate(request(csr(), 0, &[]))
        .await
        .unwrap();
    // Closing it frees the slot (the handshake fails on EOF).
    drop(silent);
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Requests: 127.0.0.2 runs one stuck request; its second waits in the
    // queue although global slots are free; its third finds the queue full.
    let tls = s
        .tls()
        .connect(
            "localhost".try_into().unwrap(),
            connect_from("127.0.0.2", s.app.addr).await,
        )
        .await
        .unwrap();
    let (send, conn) = h2::client::handshake(tls).await.unwrap();
    let _conn = tokio::spawn(conn);
    let mut send = send.ready().await.unwrap();
    let (running, _b1) = stuck_request(&mut send);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut send = send.ready().await.unwrap();
    let (queued, _b2) = stuck_request(&mut send);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut send = send.ready().await.unwrap();
    let (refused, _b3) = stuck_request(&mut send);
    // 8 = RESOURCE_EXHAUSTED, at once.
    assert_eq!(grpc_status(refused).await.as_deref(), Some("8"));
    assert_eq!(s.refusals("request_limit_per_ip").await, 1);
    // 127.0.0.1 is served while 127.0.0.2 waits.
    let t = Instant::now();
    good.create_certificate(request(csr(), 0, &[]))
        .await
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    // 4 = DEADLINE_EXCEEDED for both of 127.0.0.2's stuck requests.
    assert_eq!(grpc_status(running).await.as_deref(), Some("4"));
    assert_eq!(grpc_status(queued).await.as_deref(), Some("4"));

    // Admin: a trickling connection from 127.0.0.2 holds its source's one
    // slot; a second from it is closed; /healthz from 127.0.0.1 answers.
    let admin = s.app.admin_addr;
    let mut slow = connect_from("127.0.0.2", admin).await;
    slow.write_all(b"GET /heal").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut second = connect_from("127.0.0.2", admin).await;
    assert!(closed_within(&mut second, Duration::from_millis(500)).await);
    let (status, body) = testing::http_get(admin, "/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    assert_eq!(s.refusals("admin_connection_limit_per_ip").await, 1);
}
