//! The numbers that bound what a caller can make meshca hold, and the
//! admission decisions over them. Plain data and plain functions: the
//! listener code in the parent module only applies them.
//!
//! Memory arithmetic for the defaults (worst case, every limit reached):
//! - connections: `max_connections` x (HTTP/2 connection window of unread
//!   DATA + TLS and HTTP/2 buffers, about 48 KiB) = 1024 x (64 + 48) KiB
//!   = 112 MiB;
//! - requests: an HTTP/2 stream only costs its headers until a handler slot
//!   is free, and waiting streams beyond `max_queued_requests` are refused, so
//!   (inflight + queued) x header list = (256 + 1024) x 32 KiB = 40 MiB, plus
//!   the decoded bodies of running handlers, inflight x message = 256 x 128 KiB
//!   = 32 MiB;
//! - handshakes in flight: 128 x about 40 KiB of rustls state = 5 MiB.
//!
//! About 190 MiB with a baseline of about 20 MiB, under the chart's 256 MiB
//! limit. (Measured: an idle established connection costs about 30 KiB.)
//! `max_concurrent_streams` does not enter the sum: the global request
//! bounds do. Nor do the per-source-IP caps (handshakes, requests, admin
//! connections): they only share the global pools out fairly, and a request
//! waiting for its source's share counts against the same global queue.
//! Nor does the split by [`AuthClass`]: each class has its own per-IP caps,
//! but both draw on the same global pools, and unauthenticated callers may
//! hold only part of them ([`RequestCaps::unauthenticated`]).

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

/// Limits of the gRPC port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportLimits {
    /// Open connections (handshaking or established) across all peers.
    pub max_connections: usize,
    /// Open connections from one source IP, for each [`AuthClass`] apart
    /// (counted once the handshake tells the class).
    pub max_connections_per_ip: usize,
    /// TLS handshakes in progress; more are refused until one finishes.
    pub max_pending_handshakes: usize,
    /// TLS handshakes in progress from one source IP: a few IPs cannot
    /// take every handshake slot.
    pub max_pending_handshakes_per_ip: usize,
    pub handshake_timeout: Duration,
    /// HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS per connection.
    pub max_concurrent_streams: u32,
    /// Requests being handled (message decoded, authenticating, signing).
    pub max_inflight_requests: usize,
    /// Requests being handled for one source IP; more wait in the queue, so
    /// a few IPs cannot hold every handler slot.
    pub max_inflight_requests_per_ip: usize,
    /// Requests waiting for a handler slot; beyond this they are refused.
    pub max_queued_requests: usize,
    /// Whole-request deadline, from headers to response.
    pub request_timeout: Duration,
    /// HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE.
    pub max_header_list_bytes: u32,
    pub stream_window_bytes: u32,
    pub connection_window_bytes: u32,
    /// HTTP/2 PING period; zero disables keepalive.
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    /// GOAWAY after this age (zero: never), then close after the grace.
    pub max_connection_age: Duration,
    pub max_connection_age_grace: Duration,
    /// Requests a connection may cancel (RST_STREAM while in progress) per
    /// second before it is closed: stops open-and-reset floods.
    pub max_cancelled_streams_per_sec: u32,
    /// A stream on a connection without a verified client certificate that
    /// has not sent its whole message this long after its headers is reset
    /// (`unauthenticated_body_timeout`); zero: only `request_timeout` bounds it.
    pub unauthenticated_body_timeout: Duration,
}

impl Default for TransportLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_connections_per_ip: 64,
            max_pending_handshakes: 128,
            max_pending_handshakes_per_ip: 16,
            handshake_timeout: Duration::from_secs(5),
            max_concurrent_streams: 100,
            max_inflight_requests: 256,
            max_inflight_requests_per_ip: 32,
            max_queued_requests: 1024,
            request_timeout: Duration::from_secs(15),
            max_header_list_bytes: 32 * 1024,
            stream_window_bytes: 64 * 1024,
            connection_window_bytes: 64 * 1024,
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
            max_connection_age: Duration::from_secs(30 * 60),
            max_connection_age_grace: Duration::from_secs(10),
            max_cancelled_streams_per_sec: 200,
            unauthenticated_body_timeout: Duration::from_secs(2),
        }
    }
}

/// Limits on the fields of one request, checked before any expensive work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputLimits {
    /// Decoded protobuf message (a CSR is at most 64 KiB).
    pub max_message_bytes: usize,
    /// `authorization: Bearer` token.
    pub max_token_bytes: usize,
    /// `clusterid` header.
    pub max_cluster_id_bytes: usize,
    /// Each metadata key and each encoded metadata value (`ImpersonatedIdentity`
    /// included; a SPIFFE ID is at most 2048 bytes).
    pub max_metadata_value_bytes: usize,
    pub max_metadata_keys: usize,
}

impl Default for InputLimits {
    fn default() -> Self {
        Self {
            max_message_bytes: 128 * 1024,
            max_token_bytes: 16 * 1024,
            max_cluster_id_bytes: 256,
            max_metadata_value_bytes: 2048,
            max_metadata_keys: 16,
        }
    }
}

/// Limits of the admin (health, metrics) port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdminLimits {
    pub max_connections: usize,
    /// Open admin connections from one source IP: kubelet's probes keep a
    /// slot however many other IPs trickle.
    pub max_connections_per_ip: usize,
    /// Time to receive a request's headers.
    pub header_timeout: Duration,
    /// Longest an admin connection stays open, whatever it does.
    pub connection_timeout: Duration,
}

impl Default for AdminLimits {
    fn default() -> Self {
        Self {
            max_connections: 64,
            max_connections_per_ip: 8,
            header_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(30),
        }
    }
}

/// Why a connection or request was turned away by a transport limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Refusal {
    #[error("connection limit reached")]
    ConnectionLimit,
    #[error("per-source-IP connection limit reached")]
    PerIpLimit,
    #[error("too many TLS handshakes in progress")]
    HandshakeLimit,
    #[error("too many TLS handshakes in progress from one source IP")]
    HandshakePerIpLimit,
    #[error("TLS handshake timed out")]
    HandshakeTimeout,
    #[error("TLS handshake failed")]
    HandshakeFailed,
    #[error("too many requests waiting")]
    RequestQueueFull,
    #[error("too many requests from one source IP, and the queue is full")]
    RequestPerIpLimit,
    #[error("request timed out")]
    RequestTimeout,
    #[error("request message too large")]
    MessageTooLarge,
    #[error("admin connection limit reached")]
    AdminConnectionLimit,
    #[error("per-source-IP admin connection limit reached")]
    AdminPerIpLimit,
    #[error("admin connection timed out")]
    AdminTimeout,
    #[error("connection cancelled too many streams")]
    StreamResetFlood,
    #[error("the connection has its share of requests in progress")]
    ConnectionStreamLimit,
    #[error("an unauthenticated stream did not send its message in time")]
    UnauthenticatedBodyTimeout,
}

impl Refusal {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::ConnectionLimit => "connection_limit",
            Self::PerIpLimit => "connection_limit_per_ip",
            Self::HandshakeLimit => "handshake_limit",
            Self::HandshakePerIpLimit => "handshake_limit_per_ip",
            Self::HandshakeTimeout => "handshake_timeout",
            Self::HandshakeFailed => "handshake_failed",
            Self::RequestQueueFull => "request_queue_full",
            Self::RequestPerIpLimit => "request_limit_per_ip",
            Self::RequestTimeout => "request_timeout",
            Self::MessageTooLarge => "message_too_large",
            Self::AdminConnectionLimit => "admin_connection_limit",
            Self::AdminPerIpLimit => "admin_connection_limit_per_ip",
            Self::AdminTimeout => "admin_timeout",
            Self::StreamResetFlood => "stream_reset_flood",
            Self::ConnectionStreamLimit => "connection_stream_limit",
            Self::UnauthenticatedBodyTimeout => "unauthenticated_body_timeout",
        }
    }

    /// Every refusal, for tests and metric pre-registration.
    pub const ALL: [Refusal; 16] = [
        Self::ConnectionLimit,
        Self::PerIpLimit,
        Self::HandshakeLimit,
        Self::HandshakePerIpLimit,
        Self::HandshakeTimeout,
        Self::HandshakeFailed,
        Self::RequestQueueFull,
        Self::RequestPerIpLimit,
        Self::RequestTimeout,
        Self::MessageTooLarge,
        Self::AdminConnectionLimit,
        Self::AdminPerIpLimit,
        Self::AdminTimeout,
        Self::StreamResetFlood,
        Self::ConnectionStreamLimit,
        Self::UnauthenticatedBodyTimeout,
    ];
}

/// Which side of the transport's accounting a connection is on. Callers
/// behind one address (a NAT, a node's shared address, loopback) are
/// accounted apart by class, so unauthenticated connections from an
/// address cannot take the connection, request or signing shares of the
/// authenticated callers behind it.
///
/// A connection is `Authenticated` when its TLS handshake verified a client
/// certificate (the serving config's SPIFFE verifier, against the trust
/// bundle) and its leaf parses. Everything else is `Unauthenticated`,
/// token callers included: a bearer token is only read with the headers and
/// only verified after the message, so until then it proves nothing (anyone
/// can send the header). Token callers therefore share the unauthenticated
/// class's pools and its body timeout; a real agent sends its CSR with its
/// headers, in well under the timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AuthClass {
    Authenticated,
    Unauthenticated,
}

/// What a [`ConnCounts`] counts: each pool has its own caps and reasons.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Pool {
    /// Open gRPC connections.
    #[default]
    Connections,
    /// gRPC connections still in their TLS handshake.
    Handshakes,
    /// Open admin-port connections.
    Admin,
}

impl Pool {
    /// The refusals for a full pool: (all sources, one source IP).
    pub fn refusals(self) -> (Refusal, Refusal) {
        match self {
            Self::Connections => (Refusal::ConnectionLimit, Refusal::PerIpLimit),
            Self::Handshakes => (Refusal::HandshakeLimit, Refusal::HandshakePerIpLimit),
            Self::Admin => (Refusal::AdminConnectionLimit, Refusal::AdminPerIpLimit),
        }
    }
}

/// Open connections (or handshakes), in total and per source IP.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnCounts {
    pub pool: Pool,
    pub total: usize,
    pub per_ip: HashMap<IpAddr, usize>,
}

/// One key per host: an IPv4 peer seen through a dual-stack socket counts as itself.
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// Whether one more connection from `ip` may be opened.
pub fn admit(
    counts: &ConnCounts,
    ip: IpAddr,
    max_total: usize,
    max_per_ip: usize,
) -> Result<(), Refusal> {
    let (all, one) = counts.pool.refusals();
    if counts.total >= max_total {
        return Err(all);
    }
    if counts.per_ip.get(&canonical_ip(ip)).copied().unwrap_or(0) >= max_per_ip {
        return Err(one);
    }
    Ok(())
}

impl ConnCounts {
    pub fn new(pool: Pool) -> Self {
        Self {
            pool,
            ..Self::default()
        }
    }

    /// Counts a connection in if `admit` allows it.
    pub fn open(&mut self, ip: IpAddr, max_total: usize, max_per_ip: usize) -> Result<(), Refusal> {
        admit(self, ip, max_total, max_per_ip)?;
        self.total += 1;
        *self.per_ip.entry(canonical_ip(ip)).or_default() += 1;
        Ok(())
    }

    /// Counts a connection out; an IP with no connections leaves the map so
    /// the map never holds more entries than open connections.
    pub fn close(&mut self, ip: IpAddr) {
        let ip = canonical_ip(ip);
        self.total = self.total.saturating_sub(1);
        if let Some(n) = self.per_ip.get_mut(&ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_ip.remove(&ip);
            }
        }
    }
}

/// What to do with a request arriving when `inflight` handlers run (of
/// which `ip_inflight` for its source IP) and `queued` requests wait.
///
/// Per-source fairness: a source at its own cap waits in the shared queue
/// even when global slots are free, so header-only streams from a few IPs
/// hold at most their per-IP share of the slots (their bodies never come:
/// they time out holding a slot, and the rest stays free for other
/// sources). Waiting requests count against the one global queue, so the
/// memory arithmetic above is unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestAdmission {
    /// A handler slot is free.
    Run,
    /// Wait for a slot (bounded by the request timeout).
    Queue,
    Refuse(Refusal),
}

pub fn admit_request(
    inflight: usize,
    ip_inflight: usize,
    queued: usize,
    max: &RequestCaps,
) -> RequestAdmission {
    let ip_full = ip_inflight >= max.inflight_per_ip;
    if inflight < max.inflight && !ip_full {
        RequestAdmission::Run
    } else if queued < max.queued {
        RequestAdmission::Queue
    } else if ip_full {
        RequestAdmission::Refuse(Refusal::RequestPerIpLimit)
    } else {
        RequestAdmission::Refuse(Refusal::RequestQueueFull)
    }
}

/// The caps [`admit_request`] applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestCaps {
    pub inflight: usize,
    pub inflight_per_ip: usize,
    pub queued: usize,
}

impl RequestCaps {
    /// The caps of all requests together.
    pub fn all(limits: &TransportLimits) -> Self {
        Self {
            inflight: limits.max_inflight_requests,
            inflight_per_ip: limits.max_inflight_requests_per_ip,
            queued: limits.max_queued_requests,
        }
    }

    /// The part unauthenticated requests may hold: three quarters of the
    /// handler slots (at least one) and half of the queue (rounded up), so
    /// authenticated callers always find a quarter of the slots and half of
    /// the queue that no unauthenticated stream holds. Per source IP each class has
    /// its own `inflight_per_ip`.
    pub fn unauthenticated(limits: &TransportLimits) -> Self {
        let all = Self::all(limits);
        Self {
            inflight: (all.inflight - all.inflight / 4).max(1),
            inflight_per_ip: all.inflight_per_ip,
            queued: all.queued.div_ceil(2),
        }
    }
}

/// Cancelled streams of one connection, counted in one-second windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CancelWindow {
    /// Start of the current window, in milliseconds of the connection's clock.
    pub start_ms: u64,
    pub count: u32,
}

/// Counts one cancellation at `now_ms`; returns the new window and whether
/// the connection went over `max_per_sec`.
pub fn count_cancel(w: CancelWindow, now_ms: u64, max_per_sec: u32) -> (CancelWindow, bool) {
    let w = if now_ms.saturating_sub(w.start_ms) >= 1000 {
        CancelWindow {
            start_ms: now_ms,
            count: 1,
        }
    } else {
        CancelWindow {
            start_ms: w.start_ms,
            count: w.count.saturating_add(1),
        }
    };
    (w, w.count > max_per_sec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn counts(entries: &[(&str, usize)]) -> ConnCounts {
        let mut c = ConnCounts::default();
        for (a, n) in entries {
            c.per_ip.insert(canonical_ip(ip(a)), *n);
            c.total += n;
        }
        c
    }

    #[test_case(&[], "10.0.0.1", 2, 1, Ok(()) ; "empty admits")]
    #[test_case(&[("10.0.0.1", 1)], "10.0.0.1", 5, 1, Err(Refusal::PerIpLimit) ; "per ip full")]
    #[test_case(&[("10.0.0.1", 1)], "10.0.0.2", 5, 1, Ok(()) ; "other ip admitted")]
    #[test_case(&[("10.0.0.1", 1), ("10.0.0.2", 1)], "10.0.0.3", 2, 5, Err(Refusal::ConnectionLimit) ; "global full")]
    #[test_case(&[("10.0.0.1", 2)], "10.0.0.1", 2, 2, Err(Refusal::ConnectionLimit) ; "global checked first")]
    #[test_case(&[("10.0.0.1", 1)], "::ffff:10.0.0.1", 5, 1, Err(Refusal::PerIpLimit) ; "v4 mapped counts as v4")]
    #[test_case(&[], "10.0.0.1", 0, 5, Err(Refusal::ConnectionLimit) ; "zero global admits none")]
    fn admission(
        existing: &[(&str, usize)],
        peer: &str,
        total: usize,
        per_ip: usize,
        want: Result<(), Refusal>,
    ) {
        assert_eq!(admit(&counts(existing), ip(peer), total, per_ip), want);
    }

    #[test]
    fn open_close_round_trip_leaves_no_entries() {
        let mut c = ConnCounts::default();
        for _ in 0..3 {
            c.open(ip("10.0.0.1"), 10, 3).unwrap();
        }
        assert_eq!(c.open(ip("10.0.0.1"), 10, 3), Err(Refusal::PerIpLimit));
        c.open(ip("::ffff:10.0.0.2"), 10, 3).unwrap();
        assert_eq!(c.total, 4);
        for _ in 0..3 {
            c.close(ip("10.0.0.1"));
        }
        c.close(ip("10.0.0.2"));
        assert_eq!(c, ConnCounts::default());
        // A stray close never underflows.
        c.close(ip("10.0.0.9"));
        assert_eq!(c, ConnCounts::default());
    }

    const CAPS: RequestCaps = RequestCaps {
        inflight: 4,
        inflight_per_ip: 2,
        queued: 2,
    };

    #[test_case(0, 0, 0, RequestAdmission::Run ; "idle")]
    #[test_case(3, 1, 0, RequestAdmission::Run ; "one slot left")]
    #[test_case(4, 0, 0, RequestAdmission::Queue ; "slots full queue empty")]
    #[test_case(4, 0, 1, RequestAdmission::Queue ; "queue has room")]
    #[test_case(4, 0, 2, RequestAdmission::Refuse(Refusal::RequestQueueFull) ; "queue full")]
    #[test_case(2, 2, 0, RequestAdmission::Queue ; "source at its cap waits although slots are free")]
    #[test_case(2, 2, 2, RequestAdmission::Refuse(Refusal::RequestPerIpLimit) ; "source at its cap and queue full")]
    #[test_case(4, 2, 2, RequestAdmission::Refuse(Refusal::RequestPerIpLimit) ; "both full names the source cap")]
    #[test_case(2, 1, 2, RequestAdmission::Run ; "other source runs while one waits")]
    fn request_admission(
        inflight: usize,
        ip_inflight: usize,
        queued: usize,
        want: RequestAdmission,
    ) {
        assert_eq!(admit_request(inflight, ip_inflight, queued, &CAPS), want);
    }

    #[test]
    fn no_capacity_refuses() {
        let none = RequestCaps {
            inflight: 0,
            inflight_per_ip: 0,
            queued: 0,
        };
        assert_eq!(
            admit_request(0, 0, 0, &none),
            RequestAdmission::Refuse(Refusal::RequestPerIpLimit)
        );
    }

    #[test_case(Pool::Connections, &[("10.0.0.1", 1)], "10.0.0.1", Err(Refusal::PerIpLimit) ; "connections per ip")]
    #[test_case(Pool::Handshakes, &[("10.0.0.1", 1)], "10.0.0.1", Err(Refusal::HandshakePerIpLimit) ; "handshakes per ip")]
    #[test_case(Pool::Handshakes, &[("10.0.0.1", 1), ("10.0.0.2", 1), ("10.0.0.3", 1)], "127.0.0.1", Err(Refusal::HandshakeLimit) ; "handshakes global")]
    #[test_case(Pool::Handshakes, &[("10.0.0.1", 1), ("10.0.0.2", 1)], "127.0.0.1", Ok(()) ; "handshakes other source admitted")]
    #[test_case(Pool::Admin, &[("10.0.0.1", 1)], "::ffff:10.0.0.1", Err(Refusal::AdminPerIpLimit) ; "admin per ip")]
    #[test_case(Pool::Admin, &[("10.0.0.1", 1), ("10.0.0.2", 1), ("10.0.0.3", 1)], "127.0.0.1", Err(Refusal::AdminConnectionLimit) ; "admin global")]
    fn pools_refuse_with_their_own_reasons(
        pool: Pool,
        existing: &[(&str, usize)],
        peer: &str,
        want: Result<(), Refusal>,
    ) {
        let mut c = counts(existing);
        c.pool = pool;
        assert_eq!(admit(&c, ip(peer), 3, 1), want);
    }

    /// The defaults leave room for well-behaved sources while four hostile
    /// IPs (as in the adversarial suite) sit at their per-IP caps.
    #[test]
    fn four_sources_cannot_fill_a_global_pool() {
        let (t, a) = (TransportLimits::default(), AdminLimits::default());
        assert!(4 * t.max_pending_handshakes_per_ip < t.max_pending_handshakes);
        assert!(4 * t.max_inflight_requests_per_ip < t.max_inflight_requests);
        assert!(4 * a.max_connections_per_ip < a.max_connections);
        // Nor the unauthenticated class's part, which leaves authenticated
        // callers a quarter of the slots and half of the queue.
        let u = RequestCaps::unauthenticated(&t);
        assert!(4 * u.inflight_per_ip < u.inflight);
        assert!(u.inflight < t.max_inflight_requests && u.queued < t.max_queued_requests);
        assert!(t.max_inflight_requests - u.inflight >= t.max_inflight_requests_per_ip);
    }

    #[test_case(CancelWindow { start_ms: 0, count: 0 }, 10, 2, (CancelWindow { start_ms: 0, count: 1 }, false) ; "first")]
    #[test_case(CancelWindow { start_ms: 0, count: 2 }, 999, 2, (CancelWindow { start_ms: 0, count: 3 }, true) ; "over within the second")]
    #[test_case(CancelWindow { start_ms: 0, count: 2 }, 1000, 2, (CancelWindow { start_ms: 1000, count: 1 }, false) ; "new second starts over")]
    #[test_case(CancelWindow { start_ms: 5000, count: 2 }, 10, 2, (CancelWindow { start_ms: 5000, count: 3 }, true) ; "clock going back stays in window")]
    #[test_case(CancelWindow { start_ms: 0, count: u32::MAX }, 5, 2, (CancelWindow { start_ms: 0, count: u32::MAX }, true) ; "saturates")]
    fn cancel_budget(w: CancelWindow, now: u64, max: u32, want: (CancelWindow, bool)) {
        assert_eq!(count_cancel(w, now, max), want);
    }

    #[test]
    fn refusal_reasons_are_distinct() {
        let set: std::collections::HashSet<_> = Refusal::ALL.iter().map(|r| r.reason()).collect();
        assert_eq!(set.len(), Refusal::ALL.len());
    }

    #[test]
    fn default_worst_case_memory_is_under_the_chart_limit() {
        let (t, i) = (TransportLimits::default(), InputLimits::default());
        // Per connection: unread DATA up to the connection window + ~48 KiB buffers.
        let conns = t.max_connections * (t.connection_window_bytes as usize + 48 * 1024);
        let headers =
            (t.max_inflight_requests + t.max_queued_requests) * t.max_header_list_bytes as usize;
        let bodies = t.max_inflight_requests * i.max_message_bytes;
        let handshakes = t.max_pending_handshakes * 40 * 1024;
        let total = conns + headers + bodies + handshakes + 20 * 1024 * 1024;
        assert!(total < 256 * 1024 * 1024, "worst case {} MiB", total >> 20);
        // The token must fit in the header list, and a 64 KiB CSR in a message.
        assert!(i.max_token_bytes < t.max_header_list_bytes as usize);
        assert!(i.max_message_bytes > crate::ca::csr::MAX_CSR_BYTES);
    }
}

/// The earlier of two optional deadlines.
pub fn earliest(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod earliest_tests {
    use super::*;
    use test_case::test_case;

    #[test_case(None, None, None ; "no deadline")]
    #[test_case(Some(5), None, Some(5) ; "age only")]
    #[test_case(None, Some(3), Some(3) ; "cert only")]
    #[test_case(Some(5), Some(3), Some(3) ; "cert first")]
    #[test_case(Some(2), Some(3), Some(2) ; "age first")]
    fn picks_the_earlier(a: Option<u64>, b: Option<u64>, want: Option<u64>) {
        let s = |v: Option<u64>| v.map(Duration::from_secs);
        assert_eq!(earliest(s(a), s(b)), s(want));
    }
}
