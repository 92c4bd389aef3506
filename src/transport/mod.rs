//! Connection handling of the gRPC port: admission (global and per-IP caps),
//! bounded TLS handshakes with a timeout, and a hard end to connections that
//! outlive `max_connection_age` + grace. HTTP/2 settings are applied by the
//! caller through tonic's builder; this module owns what tonic lacks.

pub mod args;
pub mod coalesce;
pub mod gate;
pub mod limits;
pub mod metrics;
pub mod rejects;

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls_pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::Connected;

pub use limits::{AdminLimits, AuthClass, ConnCounts, InputLimits, Pool, Refusal, TransportLimits};

use self::metrics::TransportMetrics;
use crate::tls::ServingTls;

/// What a connection carries into each request's extensions.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub remote_addr: SocketAddr,
    pub peer_chain: Option<Arc<[CertificateDer<'static>]>>,
    /// `peer_chain[0]` parsed once for all the connection's requests.
    pub peer_leaf: Option<Arc<Result<crate::authn::mtls::Leaf, crate::authn::mtls::MtlsError>>>,
    /// Lets request handling close the connection it arrived on.
    pub control: Arc<ConnControl>,
}

impl ConnInfo {
    /// Authenticated when the handshake verified a client certificate and
    /// its leaf parses ([`AuthClass`]).
    pub fn class(&self) -> AuthClass {
        class_of(self.peer_leaf.as_deref())
    }
}

fn class_of(
    leaf: Option<&Result<crate::authn::mtls::Leaf, crate::authn::mtls::MtlsError>>,
) -> AuthClass {
    match leaf {
        Some(Ok(_)) => AuthClass::Authenticated,
        _ => AuthClass::Unauthenticated,
    }
}

/// Per-connection state shared between the connection and its requests.
#[derive(Debug)]
pub struct ConnControl {
    born: std::time::Instant,
    closed: std::sync::atomic::AtomicBool,
    waker: futures::task::AtomicWaker,
    cancels: Mutex<limits::CancelWindow>,
    max_cancels_per_sec: u32,
    /// Requests in progress on this connection (the request gate counts them).
    streams: std::sync::atomic::AtomicUsize,
    /// Woken when one of them ends, for streams waiting for a place.
    freed: tokio::sync::Notify,
    /// Tickets of the streams waiting for a place, so that under overload
    /// the newest takes a freed one.
    waiting: Mutex<Waiting>,
}

#[derive(Debug, Default)]
struct Waiting {
    next: u64,
    tickets: std::collections::BTreeSet<u64>,
}

/// A stream's place among its connection's waiting streams (left on drop).
#[derive(Debug)]
pub struct WaitTicket {
    control: Arc<ConnControl>,
    ticket: u64,
}

impl WaitTicket {
    /// No stream that began waiting later is still waiting.
    pub fn is_newest(&self) -> bool {
        self.control.waiting().tickets.last() == Some(&self.ticket)
    }
}

impl Drop for WaitTicket {
    fn drop(&mut self) {
        self.control.waiting().tickets.remove(&self.ticket);
    }
}

impl ConnControl {
    pub fn new(max_cancels_per_sec: u32) -> Arc<Self> {
        Arc::new(Self {
            born: std::time::Instant::now(),
            closed: Default::default(),
            waker: Default::default(),
            cancels: Mutex::new(limits::CancelWindow {
                start_ms: 0,
                count: 0,
            }),
            max_cancels_per_sec,
            streams: Default::default(),
            freed: tokio::sync::Notify::new(),
            waiting: Default::default(),
        })
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, Waiting> {
        crate::primitives::lock(&self.waiting)
    }

    /// Joins the streams waiting for a place, as the newest.
    pub fn wait_ticket(self: &Arc<Self>) -> WaitTicket {
        let mut w = self.waiting();
        let ticket = w.next;
        w.next += 1;
        w.tickets.insert(ticket);
        WaitTicket {
            control: self.clone(),
            ticket,
        }
    }

    /// One more request in progress if `admit` allows it given how many
    /// there are; returns how many there were before.
    pub fn try_stream_start(&self, admit: impl Fn(usize) -> bool) -> Option<usize> {
        use std::sync::atomic::Ordering;
        self.streams
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                admit(n).then_some(n + 1)
            })
            .ok()
    }

    /// A request ended; returns how many are left in progress.
    pub fn stream_ended(&self) -> usize {
        let left = self
            .streams
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel)
            .saturating_sub(1);
        self.freed.notify_waiters();
        left
    }

    /// Resolves when one of this connection's requests ends after the
    /// returned future was first polled or enabled.
    pub fn freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
    }

    /// Makes the connection's next read or write fail, which ends it.
    pub fn close(&self) {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        self.waker.wake();
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Counts a request the client cancelled; closes the connection (and
    /// returns true) once it goes over its budget.
    pub fn stream_cancelled(&self) -> bool {
        let now_ms = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX);
        let over = {
            let mut w = crate::primitives::lock(&self.cancels);
            let (next, over) = limits::count_cancel(*w, now_ms, self.max_cancels_per_sec);
            *w = next;
            over
        };
        if over && !self.is_closed() {
            self.close();
            return true;
        }
        false
    }

    fn poll_closed(&self, cx: &mut Context<'_>) -> bool {
        self.waker.register(cx.waker());
        self.is_closed()
    }
}

/// Open-connection (or pending-handshake) counts shared by the accept loop
/// and live connections.
#[derive(Debug)]
pub struct ConnTracker {
    counts: Mutex<ConnCounts>,
    max_total: usize,
    max_per_ip: usize,
    metrics: Option<Arc<TransportMetrics>>,
}

impl ConnTracker {
    pub fn new(
        max_total: usize,
        max_per_ip: usize,
        metrics: Option<Arc<TransportMetrics>>,
    ) -> Arc<Self> {
        Self::for_pool(Pool::Connections, max_total, max_per_ip, metrics)
    }

    pub fn for_pool(
        pool: Pool,
        max_total: usize,
        max_per_ip: usize,
        metrics: Option<Arc<TransportMetrics>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            counts: Mutex::new(ConnCounts::new(pool)),
            max_total,
            max_per_ip,
            metrics,
        })
    }

    /// Admits a connection from `ip`; the permit counts it until dropped.
    pub fn open(self: &Arc<Self>, ip: IpAddr) -> Result<ConnPermit, Refusal> {
        let total = {
            let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
            c.open(ip, self.max_total, self.max_per_ip)?;
            c.total
        };
        self.set_gauge(total);
        Ok(ConnPermit {
            tracker: self.clone(),
            ip,
        })
    }

    pub fn open_connections(&self) -> usize {
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).total
    }

    fn set_gauge(&self, total: usize) {
        let Some(m) = &self.metrics else { return };
        let pool = self.counts.lock().unwrap_or_else(|p| p.into_inner()).pool;
        match pool {
            Pool::Connections => {
                m.open_connections.set(total as i64);
            }
            Pool::Handshakes => {
                m.pending_handshakes.set(total as i64);
            }
            Pool::Admin => {}
        }
    }
}

/// One admitted connection; counted out on drop.
#[derive(Debug)]
pub struct ConnPermit {
    tracker: Arc<ConnTracker>,
    ip: IpAddr,
}

impl Drop for ConnPermit {
    fn drop(&mut self) {
        let total = {
            let mut c = self
                .tracker
                .counts
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            c.close(self.ip);
            c.total
        };
        self.tracker.set_gauge(total);
    }
}

/// Open connections per source IP, each [`AuthClass`] under its own
/// `max_connections_per_ip`.
#[derive(Debug)]
struct ClassTrackers {
    authenticated: Arc<ConnTracker>,
    unauthenticated: Arc<ConnTracker>,
}

impl ClassTrackers {
    fn new(limits: &TransportLimits) -> Self {
        let one = || ConnTracker::new(limits.max_connections, limits.max_connections_per_ip, None);
        Self {
            authenticated: one(),
            unauthenticated: one(),
        }
    }

    fn open(&self, class: AuthClass, ip: IpAddr) -> Result<ConnPermit, Refusal> {
        match class {
            AuthClass::Authenticated => self.authenticated.open(ip),
            AuthClass::Unauthenticated => self.unauthenticated.open(ip),
        }
    }
}

fn refuse(metrics: Option<&TransportMetrics>, r: Refusal, peer: SocketAddr) {
    tracing::debug!(%peer, reason = r.reason(), "connection refused");
    if let Some(m) = metrics {
        m.refused(r);
    }
}

/// A TLS connection handed to tonic. Holds its admission permit, and fails
/// I/O once past its hard deadline (`max_connection_age` + grace): tonic's
/// own grace handling skips the graceful GOAWAY, so tonic only gets the age
/// and this wrapper enforces the grace.
pub struct TlsConn {
    inner: tokio_rustls::server::TlsStream<TcpStream>,
    info: ConnInfo,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The first bytes (the HTTP/2 preface) must arrive by then: hyper has
    /// no timeout of its own before the preface.
    first_read: Option<Pin<Box<tokio::time::Sleep>>>,
    metrics: Option<Arc<TransportMetrics>>,
    /// Plaintext written by h2 and not yet given to TLS (see `coalesce`).
    out: Vec<u8>,
    frames: coalesce::FrameTracker,
    /// A flush was held back: `out` goes at the next read, write or flush.
    held: bool,
    _permit: ConnPermit,
    /// Its count within its class's per-IP cap.
    _class_permit: ConnPermit,
}

impl TlsConn {
    /// Gives the held plaintext to TLS (one record per 16 KiB).
    fn push_out(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while !self.out.is_empty() {
            let n = std::task::ready!(Pin::new(&mut self.inner).poll_write(cx, &self.out))?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.out.drain(..n);
        }
        Poll::Ready(Ok(()))
    }

    /// Sends everything written so far.
    fn release(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        std::task::ready!(self.push_out(cx))?;
        // Idle connections keep no buffer, so 10k idle callers stay at or under 64 KiB each.
        self.out = Vec::new();
        // Held until TLS has flushed too: h2 already took this flush as done.
        std::task::ready!(Pin::new(&mut self.inner).poll_flush(cx))?;
        self.held = false;
        Poll::Ready(Ok(()))
    }

    /// Whether the client sent nothing in time after the handshake.
    fn silent(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(d) = self.first_read.as_mut() else {
            return false;
        };
        if d.as_mut().poll(cx).is_pending() {
            return false;
        }
        self.first_read = None;
        refuse(
            self.metrics.as_deref(),
            Refusal::HandshakeTimeout,
            self.info.remote_addr,
        );
        true
    }

    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        if self.info.control.poll_closed(cx) {
            return true;
        }
        match self.deadline.as_mut() {
            Some(d) => d.as_mut().poll(cx).is_ready(),
            None => false,
        }
    }
}

fn age_exceeded() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "connection exceeded its max age and grace, or was closed for abuse",
    )
}

impl Connected for TlsConn {
    type ConnectInfo = ConnInfo;
    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

impl AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.expired(cx) {
            return Poll::Ready(Err(age_exceeded()));
        }
        if self.silent(cx) {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no HTTP/2 preface within the handshake timeout",
            )));
        }
        if self.held {
            // A held-back flush goes out now at the latest.
            if let Poll::Ready(Err(e)) = self.release(cx) {
                return Poll::Ready(Err(e));
            }
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.first_read = None;
        }
        r
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.poll_write_vectored(cx, &[std::io::IoSlice::new(buf)])
    }
    /// Copies into `out` (up to `coalesce::HOLD_MAX`); TLS gets it at the flush.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.expired(cx) {
            return Poll::Ready(Err(age_exceeded()));
        }
        if this.out.len() >= coalesce::HOLD_MAX {
            std::task::ready!(this.push_out(cx))?;
        }
        if this.out.capacity() == 0 {
            this.out.reserve(4096);
        }
        let mut written = 0;
        for b in bufs {
            let room = coalesce::HOLD_MAX.saturating_sub(this.out.len());
            if room == 0 {
                break;
            }
            let part = &b[..b.len().min(room)];
            this.out.extend_from_slice(part);
            this.frames.feed(part);
            written += part.len();
        }
        Poll::Ready(Ok(written))
    }
    fn is_write_vectored(&self) -> bool {
        true
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.out.is_empty() && this.frames.may_hold() {
            // The frames that follow usually come in this same poll; the
            // wake-up bounds the wait to the next poll of the connection
            // (whose read releases `out`) if they do not.
            this.held = true;
            cx.waker().wake_by_ref();
            return Poll::Ready(Ok(()));
        }
        this.release(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.release(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

/// Time left until `not_after` (unix seconds); zero if past or unreadable.
pub fn until_unix(not_after: i64, now: time::OffsetDateTime) -> Duration {
    time::OffsetDateTime::from_unix_timestamp(not_after)
        .ok()
        .and_then(|t| Duration::try_from(t - now).ok())
        .unwrap_or(Duration::ZERO)
}

/// Counts a rejected handshake by reason and hands it to the audit table.
fn rejected(
    metrics: Option<&TransportMetrics>,
    table: Option<&rejects::HandshakeRejects>,
    remote: SocketAddr,
    reason: &'static str,
) {
    let overflow = table.is_some_and(|t| t.add(remote.ip(), reason));
    if let Some(m) = metrics {
        m.handshake_rejects
            .get_or_create(&crate::metrics::RefusalLabels { reason })
            .inc();
        if overflow {
            m.handshake_rejects_overflow.inc();
        }
    }
}

/// The hard end of a connection opened now, if connections age out.
pub fn hard_deadline(limits: &TransportLimits) -> Option<Duration> {
    (!limits.max_connection_age.is_zero())
        .then(|| limits.max_connection_age + limits.max_connection_age_grace)
}

/// Accepts TCP connections, admits them against the connection caps, and
/// completes TLS handshakes (at most `max_pending_handshakes` at once, each
/// within `handshake_timeout`) off the accept loop; yields finished
/// connections. Refusals are counted, not logged above debug: under attack
/// they are the common case.
pub fn tls_incoming(
    listener: TcpListener,
    tls: Arc<ServingTls>,
    limits: &TransportLimits,
    metrics: Option<Arc<TransportMetrics>>,
    rejects: Option<Arc<rejects::HandshakeRejects>>,
    aggregator: Option<Arc<crate::audit::aggregate::Aggregator>>,
) -> tokio_stream::wrappers::ReceiverStream<Result<TlsConn, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(128);
    // The global cap is taken at accept; the per-IP cap once the handshake
    // tells the connection's class, each class counted apart, so that
    // unauthenticated connections from an address (a NAT, a node's shared
    // address) cannot take the places of the authenticated ones behind it.
    // Until then a source holds at most its pending-handshake share.
    let tracker = ConnTracker::new(
        limits.max_connections,
        limits.max_connections,
        metrics.clone(),
    );
    let classes = Arc::new(ClassTrackers::new(limits));
    // Per-source fairness: one IP can hold at most its share of the
    // handshake slots, so a few slowloris sources cannot refuse everyone.
    let handshakes = ConnTracker::for_pool(
        Pool::Handshakes,
        limits.max_pending_handshakes,
        limits.max_pending_handshakes_per_ip,
        metrics.clone(),
    );
    let handshake_timeout = limits.handshake_timeout;
    let deadline = hard_deadline(limits);
    let max_cancels = limits.max_cancelled_streams_per_sec;
    tokio::spawn(async move {
        loop {
            let (tcp, remote_addr) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if tx.is_closed() {
                return;
            }
            let m = metrics.as_deref();
            // Refused before any request exists: counted per source in the
            // audit log's aggregate records, not only in metrics.
            let folded = |r: Refusal| {
                refuse(m, r, remote_addr);
                if let Some(a) = &aggregator {
                    a.fold_transport(remote_addr.ip(), r.reason());
                }
            };
            let permit = match tracker.open(remote_addr.ip()) {
                Ok(p) => p,
                Err(r) => {
                    folded(r);
                    continue;
                }
            };
            let slot = match handshakes.open(remote_addr.ip()) {
                Ok(s) => s,
                Err(r) => {
                    folded(r);
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.current());
            let (tx, metrics, rejects) = (tx.clone(), metrics.clone(), rejects.clone());
            let (classes, aggregator) = (classes.clone(), aggregator.clone());
            tokio::spawn(async move {
                let result = tokio::time::timeout(handshake_timeout, acceptor.accept(tcp)).await;
                drop(slot);
                let stream = match result {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(e)) => {
                        tracing::debug!(peer = %remote_addr, error = %e, "TLS handshake failed");
                        refuse(metrics.as_deref(), Refusal::HandshakeFailed, remote_addr);
                        rejected(
                            metrics.as_deref(),
                            rejects.as_deref(),
                            remote_addr,
                            rejects::handshake_reason(&e),
                        );
                        return;
                    }
                    Err(_) => {
                        refuse(metrics.as_deref(), Refusal::HandshakeTimeout, remote_addr);
                        rejected(
                            metrics.as_deref(),
                            rejects.as_deref(),
                            remote_addr,
                            Refusal::HandshakeTimeout.reason(),
                        );
                        return;
                    }
                };
                let peer_chain = stream.get_ref().1.peer_certificates().map(|c| {
                    c.iter()
                        .map(|c| c.clone().into_owned())
                        .collect::<Vec<_>>()
                        .into()
                });
                // A connection never outlives its client certificate: it is
                // closed at notAfter (requests are also checked one by one).
                let peer_leaf = peer_chain
                    .as_deref()
                    .and_then(|c: &[CertificateDer<'static>]| c.first())
                    .map(|leaf| Arc::new(crate::authn::mtls::leaf_of(leaf, None)));
                let cert_left = peer_leaf.as_deref().map(|leaf| match leaf {
                    Ok(l) => until_unix(l.not_after, time::OffsetDateTime::now_utc()),
                    Err(_) => Duration::ZERO,
                });
                let deadline = limits::earliest(deadline, cert_left);
                let class_permit =
                    match classes.open(class_of(peer_leaf.as_deref()), remote_addr.ip()) {
                        Ok(p) => p,
                        Err(r) => {
                            refuse(metrics.as_deref(), r, remote_addr);
                            if let Some(a) = &aggregator {
                                a.fold_transport(remote_addr.ip(), r.reason());
                            }
                            return;
                        }
                    };
                let conn = TlsConn {
                    inner: stream,
                    info: ConnInfo {
                        remote_addr,
                        peer_chain,
                        peer_leaf,
                        control: ConnControl::new(max_cancels),
                    },
                    deadline: deadline.map(|d| Box::pin(tokio::time::sleep(d))),
                    first_read: Some(Box::pin(tokio::time::sleep(handshake_timeout))),
                    metrics,
                    out: Vec::new(),
                    frames: Default::default(),
                    held: false,
                    _permit: permit,
                    _class_permit: class_permit,
                };
                let _ = tx.send(Ok(conn)).await;
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
