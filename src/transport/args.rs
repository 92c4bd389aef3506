//! Flags bounding what callers can make the server hold.

use std::time::Duration;

use super::limits::{AdminLimits, InputLimits, TransportLimits};
use crate::flags::{bounded, bounded_duration, err, ConfigError, MAX_PERIOD};

/// Flags bounding what callers can make the server hold (see
/// `transport::limits` for the memory arithmetic behind the defaults).
#[derive(Debug, Clone, clap::Args)]
pub struct LimitArgs {
    /// Open gRPC connections (handshaking or established), all peers together.
    ///
    /// Beyond, new connections are closed at once. Worst-case memory of every limit together:
    /// docs/configuration.md, Transport limits and memory.
    #[arg(long, env = "MESHCA_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,
    /// Open gRPC connections from one source IP, per class.
    ///
    /// A ztunnel needs one, a sidecar one per pod IP. Connections with a verified client
    /// certificate and connections without one are counted apart, once the handshake tells which
    /// (`connection_limit_per_ip`), so unauthenticated connections from an address (a NAT, a
    /// node's shared address) cannot take the places of the authenticated callers behind it.
    #[arg(long, env = "MESHCA_MAX_CONNECTIONS_PER_IP", default_value_t = 64)]
    pub max_connections_per_ip: usize,
    /// TLS handshakes in progress; connections beyond are closed at once.
    #[arg(long, env = "MESHCA_MAX_PENDING_HANDSHAKES", default_value_t = 128)]
    pub max_pending_handshakes: usize,
    /// TLS handshakes in progress from one source IP.
    ///
    /// Refusal `handshake_limit_per_ip`, so a few slowloris sources cannot take every handshake
    /// slot.
    #[arg(
        long,
        env = "MESHCA_MAX_PENDING_HANDSHAKES_PER_IP",
        default_value_t = 16
    )]
    pub max_pending_handshakes_per_ip: usize,
    /// Time a client has to complete the TLS handshake, and again to send
    /// the HTTP/2 preface after it.
    #[arg(long, env = "MESHCA_HANDSHAKE_TIMEOUT", default_value = "5s")]
    pub handshake_timeout: String,
    /// HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS per connection.
    ///
    /// tonic's default is unlimited.
    #[arg(long, env = "MESHCA_MAX_CONCURRENT_STREAMS", default_value_t = 100)]
    pub max_concurrent_streams: u32,
    /// Requests handled at once; more wait in a queue.
    ///
    /// Handled means: message read, authenticating, signing.
    #[arg(long, env = "MESHCA_MAX_INFLIGHT_REQUESTS", default_value_t = 256)]
    pub max_inflight_requests: usize,
    /// Requests handled at once for one source IP; more wait in the queue.
    ///
    /// More wait in the shared queue (refused as `request_limit_per_ip` when it is full), so
    /// streams that never send their message hold only their source's share. Counted for each
    /// class apart: connections with a verified client certificate, and without (token callers
    /// are in the second until their token is verified, after their message). Unauthenticated
    /// requests together hold at most three quarters of `--max-inflight-requests` and half of
    /// `--max-queued-requests`; the rest is always left to authenticated callers.
    #[arg(
        long,
        env = "MESHCA_MAX_INFLIGHT_REQUESTS_PER_IP",
        default_value_t = 32
    )]
    pub max_inflight_requests_per_ip: usize,
    /// Requests waiting for a handler; beyond, RESOURCE_EXHAUSTED.
    ///
    /// The refusal is immediate, with a 1 s retry hint (`grpc-retry-pushback-ms`, RetryInfo).
    #[arg(long, env = "MESHCA_MAX_QUEUED_REQUESTS", default_value_t = 1024)]
    pub max_queued_requests: usize,
    /// Whole-request deadline (DEADLINE_EXCEEDED after it).
    ///
    /// Queueing included.
    #[arg(long, env = "MESHCA_REQUEST_TIMEOUT", default_value = "15s")]
    pub request_timeout: String,
    /// HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE.
    #[arg(long, env = "MESHCA_MAX_HEADER_LIST_BYTES", default_value_t = 32 * 1024)]
    pub max_header_list_bytes: u32,
    /// HTTP/2 initial stream flow-control window.
    ///
    /// With the connection window, what a connection can make meshca buffer unread.
    #[arg(long, env = "MESHCA_HTTP2_STREAM_WINDOW_BYTES", default_value_t = 64 * 1024)]
    pub http2_stream_window_bytes: u32,
    /// HTTP/2 initial connection flow-control window.
    ///
    /// With the stream window, what a connection can make meshca buffer unread.
    #[arg(long, env = "MESHCA_HTTP2_CONNECTION_WINDOW_BYTES", default_value_t = 64 * 1024)]
    pub http2_connection_window_bytes: u32,
    /// HTTP/2 PING period (0s disables keepalive).
    ///
    /// As istiod's keepalive default.
    #[arg(long, env = "MESHCA_KEEPALIVE_INTERVAL", default_value = "30s")]
    pub keepalive_interval: String,
    /// Time to wait for a PING ack before closing the connection.
    ///
    /// As istiod's keepalive default.
    #[arg(long, env = "MESHCA_KEEPALIVE_TIMEOUT", default_value = "10s")]
    pub keepalive_timeout: String,
    /// Connections get a GOAWAY at this age (0s: never), as istiod's
    /// keepaliveMaxServerConnectionAge.
    #[arg(long, env = "MESHCA_MAX_CONNECTION_AGE", default_value = "30m")]
    pub max_connection_age: String,
    /// After the GOAWAY, in-flight requests get this long before the connection is closed.
    ///
    /// As istiod's keepaliveMaxServerConnectionAge grace.
    #[arg(long, env = "MESHCA_MAX_CONNECTION_AGE_GRACE", default_value = "10s")]
    pub max_connection_age_grace: String,
    /// Requests one connection may cancel per second before it is closed
    /// (open-and-reset floods).
    #[arg(
        long,
        env = "MESHCA_MAX_CANCELLED_STREAMS_PER_SECOND",
        default_value_t = 200
    )]
    pub max_cancelled_streams_per_second: u32,
    /// Time a stream without a verified client certificate has to send its whole message.
    ///
    /// Counted from its headers, its wait for a request-gate slot included (token callers are
    /// unauthenticated until their token is verified); then it is answered `RESOURCE_EXHAUSTED`
    /// with pushback and reset (`unauthenticated_body_timeout`, folded into aggregate audit
    /// records). Such a stream's message is read by the gate before it takes a place in its
    /// connection's share of the signing capacity. `0s`: only `--request-timeout` bounds it.
    #[arg(
        long,
        env = "MESHCA_UNAUTHENTICATED_BODY_TIMEOUT",
        default_value = "2s"
    )]
    pub unauthenticated_body_timeout: String,
    /// Largest request message (a CSR is at most 64 KiB).
    ///
    /// istiod allows 4 MiB. A larger message gets `RESOURCE_EXHAUSTED` before decoding.
    #[arg(long, env = "MESHCA_MAX_REQUEST_BYTES", default_value_t = 128 * 1024)]
    pub max_request_bytes: usize,
    /// Largest bearer token.
    ///
    /// A larger one is `Unauthenticated` (`authn_token_too_large`) without a TokenReview.
    #[arg(long, env = "MESHCA_MAX_TOKEN_BYTES", default_value_t = 16 * 1024)]
    pub max_token_bytes: usize,
    /// Largest `clusterid` header.
    ///
    /// Reason `authn_clusterid_too_large`.
    #[arg(long, env = "MESHCA_MAX_CLUSTER_ID_BYTES", default_value_t = 256)]
    pub max_cluster_id_bytes: usize,
    /// Largest metadata key or value (ImpersonatedIdentity included).
    ///
    /// A SPIFFE ID is at most 2048 bytes; larger is `InvalidArgument`.
    #[arg(long, env = "MESHCA_MAX_METADATA_VALUE_BYTES", default_value_t = 2048)]
    pub max_metadata_value_bytes: usize,
    /// Most metadata keys in one request.
    #[arg(long, env = "MESHCA_MAX_METADATA_KEYS", default_value_t = 16)]
    pub max_metadata_keys: usize,
    /// Open admin-port connections.
    #[arg(long, env = "MESHCA_ADMIN_MAX_CONNECTIONS", default_value_t = 64)]
    pub admin_max_connections: usize,
    /// Open admin-port connections from one source IP.
    ///
    /// Refusal `admin_connection_limit_per_ip`, so kubelet's probes get in while others trickle.
    #[arg(long, env = "MESHCA_ADMIN_MAX_CONNECTIONS_PER_IP", default_value_t = 8)]
    pub admin_max_connections_per_ip: usize,
    /// Time to receive an admin request's headers.
    #[arg(long, env = "MESHCA_ADMIN_HEADER_TIMEOUT", default_value = "5s")]
    pub admin_header_timeout: String,
    /// Longest an admin connection stays open.
    #[arg(long, env = "MESHCA_ADMIN_CONNECTION_TIMEOUT", default_value = "30s")]
    pub admin_connection_timeout: String,
}

impl LimitArgs {
    /// Parses and validates the limits; every error names its variable.
    pub fn parse(&self) -> Result<(TransportLimits, InputLimits, AdminLimits), ConfigError> {
        const MIB: usize = 1024 * 1024;
        let d = bounded_duration;
        // HTTP/2 caps a window at 2^31-1 and a header list at u32; h2 needs a
        // window of at least one max-size frame to make progress.
        let window = |name, v: u32| bounded(name, v, 16 * 1024, (1 << 31) - 1);
        let t = TransportLimits {
            max_connections: bounded("MESHCA_MAX_CONNECTIONS", self.max_connections, 1, 1 << 20)?,
            max_connections_per_ip: bounded(
                "MESHCA_MAX_CONNECTIONS_PER_IP",
                self.max_connections_per_ip,
                1,
                1 << 20,
            )?,
            max_pending_handshakes: bounded(
                "MESHCA_MAX_PENDING_HANDSHAKES",
                self.max_pending_handshakes,
                1,
                1 << 16,
            )?,
            max_pending_handshakes_per_ip: bounded(
                "MESHCA_MAX_PENDING_HANDSHAKES_PER_IP",
                self.max_pending_handshakes_per_ip,
                1,
                1 << 16,
            )?,
            handshake_timeout: d(
                "MESHCA_HANDSHAKE_TIMEOUT",
                &self.handshake_timeout,
                false,
                Duration::from_secs(300),
            )?,
            max_concurrent_streams: bounded(
                "MESHCA_MAX_CONCURRENT_STREAMS",
                self.max_concurrent_streams,
                1,
                1 << 20,
            )?,
            // Semaphore permits are capped far below this.
            max_inflight_requests: bounded(
                "MESHCA_MAX_INFLIGHT_REQUESTS",
                self.max_inflight_requests,
                1,
                1 << 20,
            )?,
            max_inflight_requests_per_ip: bounded(
                "MESHCA_MAX_INFLIGHT_REQUESTS_PER_IP",
                self.max_inflight_requests_per_ip,
                1,
                1 << 20,
            )?,
            max_queued_requests: bounded(
                "MESHCA_MAX_QUEUED_REQUESTS",
                self.max_queued_requests,
                0,
                1 << 20,
            )?,
            request_timeout: d(
                "MESHCA_REQUEST_TIMEOUT",
                &self.request_timeout,
                false,
                Duration::from_secs(3600),
            )?,
            max_header_list_bytes: bounded(
                "MESHCA_MAX_HEADER_LIST_BYTES",
                self.max_header_list_bytes,
                4096,
                16 << 20,
            )?,
            stream_window_bytes: window(
                "MESHCA_HTTP2_STREAM_WINDOW_BYTES",
                self.http2_stream_window_bytes,
            )?,
            connection_window_bytes: window(
                "MESHCA_HTTP2_CONNECTION_WINDOW_BYTES",
                self.http2_connection_window_bytes,
            )?,
            keepalive_interval: d(
                "MESHCA_KEEPALIVE_INTERVAL",
                &self.keepalive_interval,
                true,
                MAX_PERIOD,
            )?,
            keepalive_timeout: d(
                "MESHCA_KEEPALIVE_TIMEOUT",
                &self.keepalive_timeout,
                false,
                Duration::from_secs(3600),
            )?,
            max_connection_age: d(
                "MESHCA_MAX_CONNECTION_AGE",
                &self.max_connection_age,
                true,
                Duration::from_secs(30 * 24 * 3600),
            )?,
            max_connection_age_grace: d(
                "MESHCA_MAX_CONNECTION_AGE_GRACE",
                &self.max_connection_age_grace,
                true,
                Duration::from_secs(3600),
            )?,
            max_cancelled_streams_per_sec: bounded(
                "MESHCA_MAX_CANCELLED_STREAMS_PER_SECOND",
                self.max_cancelled_streams_per_second,
                1,
                1 << 20,
            )?,
            unauthenticated_body_timeout: d(
                "MESHCA_UNAUTHENTICATED_BODY_TIMEOUT",
                &self.unauthenticated_body_timeout,
                true,
                Duration::from_secs(3600),
            )?,
        };
        let i = InputLimits {
            // istiod's own ceiling is 4 MiB; below 64 KiB + framing no CSR fits.
            max_message_bytes: bounded(
                "MESHCA_MAX_REQUEST_BYTES",
                self.max_request_bytes,
                crate::ca::csr::MAX_CSR_BYTES + 1024,
                4 * MIB,
            )?,
            max_token_bytes: bounded("MESHCA_MAX_TOKEN_BYTES", self.max_token_bytes, 1024, MIB)?,
            max_cluster_id_bytes: bounded(
                "MESHCA_MAX_CLUSTER_ID_BYTES",
                self.max_cluster_id_bytes,
                1,
                64 * 1024,
            )?,
            max_metadata_value_bytes: bounded(
                "MESHCA_MAX_METADATA_VALUE_BYTES",
                self.max_metadata_value_bytes,
                256,
                MIB,
            )?,
            max_metadata_keys: bounded(
                "MESHCA_MAX_METADATA_KEYS",
                self.max_metadata_keys,
                2,
                4096,
            )?,
        };
        // A token the header list cannot carry would be refused by HTTP/2
        // with a less precise error; say so now.
        if i.max_token_bytes >= t.max_header_list_bytes as usize {
            return Err(err(
                "MESHCA_MAX_TOKEN_BYTES",
                &i.max_token_bytes.to_string(),
                "must be below MESHCA_MAX_HEADER_LIST_BYTES",
            ));
        }
        let a = AdminLimits {
            max_connections: bounded(
                "MESHCA_ADMIN_MAX_CONNECTIONS",
                self.admin_max_connections,
                1,
                1 << 16,
            )?,
            max_connections_per_ip: bounded(
                "MESHCA_ADMIN_MAX_CONNECTIONS_PER_IP",
                self.admin_max_connections_per_ip,
                1,
                1 << 16,
            )?,
            header_timeout: d(
                "MESHCA_ADMIN_HEADER_TIMEOUT",
                &self.admin_header_timeout,
                false,
                Duration::from_secs(300),
            )?,
            connection_timeout: d(
                "MESHCA_ADMIN_CONNECTION_TIMEOUT",
                &self.admin_connection_timeout,
                false,
                Duration::from_secs(3600),
            )?,
        };
        Ok((t, i, a))
    }
}
