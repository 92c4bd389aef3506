//! The gRPC surface: `istio.v1.auth.IstioCertificateService` over TLS. The only
//! module that knows `tonic::Status`.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use prost::Message as _;
use prost_types::value::Kind;
use tonic::codegen::http;
use tonic::{Request, Response, Status};

use crate::authn::{AuthnError, Credentials};
use crate::ca::TtlError;
use crate::issue::{CertificateIssuer, IssueError, IssueRequest, RequestError};
use crate::proto::istio_certificate_service_server::{
    IstioCertificateService, IstioCertificateServiceServer,
};
use crate::proto::{IstioCertificateRequest, IstioCertificateResponse};
use crate::transport::gate::RequestGate;
use crate::transport::metrics::TransportMetrics;
pub use crate::transport::{AuthClass, ConnInfo, InputLimits, Refusal, TransportLimits};

/// Metadata key a node proxy uses to ask for another workload's identity.
pub const IMPERSONATED_IDENTITY: &str = "ImpersonatedIdentity";
/// Metadata key selecting a signer; accepted and ignored (as istiod's built-in CA).
pub const CERT_SIGNER: &str = "CertSigner";

/// Opaque messages, as istiod: the precise reason is only in the audit log.
const AUTHN_FAILURE: &str = "request authenticate failure";
const IMPERSONATION_FAILURE: &str = "request impersonation authentication failure";

impl From<IssueError> for Status {
    fn from(err: IssueError) -> Self {
        match err {
            // meshca's own TokenReview budget refused before any review: a
            // shed like admission's, with the budget's own retry hint.
            IssueError::Unauthenticated(AuthnError::Overloaded { retry_after, .. }) => {
                pushback_status(retry_after)
            }
            IssueError::Unauthenticated(e) if e.is_retryable() => {
                Status::unavailable(AUTHN_FAILURE)
            }
            IssueError::Unauthenticated(_) => Status::unauthenticated(AUTHN_FAILURE),
            IssueError::Impersonation(e) if e.is_unavailable() => {
                Status::unavailable(IMPERSONATION_FAILURE)
            }
            IssueError::Impersonation(_) => Status::unauthenticated(IMPERSONATION_FAILURE),
            IssueError::Request(e) => Status::invalid_argument(format!("CSR signing error ({e})")),
            IssueError::Csr(e) => Status::invalid_argument(format!("CSR signing error ({e})")),
            IssueError::Ttl(e @ TtlError::TooLong { .. }) => {
                Status::invalid_argument(format!("CSR signing error ({e})"))
            }
            IssueError::Ttl(e @ TtlError::SignerExpired(_)) => {
                Status::internal(format!("CSR signing error ({e})"))
            }
            // The key holder (HSM) is down: retryable, and the token's name stays in the audit log.
            IssueError::Sign(crate::ca::SignError::Signer(_)) => {
                Status::unavailable("CSR signing error (signing key unavailable)")
            }
            IssueError::Sign(e) => Status::internal(format!("CSR signing error ({e})")),
            IssueError::Audit(_) => Status::internal("CSR signing error (audit log unavailable)"),
            IssueError::AuditShed(_) => Status::unavailable("CSR signing error (audit log busy)"),
            IssueError::Shed(shed) => shed_status(&shed),
            IssueError::Renewal(e) if e.is_unavailable() => Status::unavailable(AUTHN_FAILURE),
            IssueError::Renewal(_)
            | IssueError::Denied(_)
            | IssueError::Revoked(_)
            | IssueError::LineageRevoked { .. } => Status::unauthenticated(AUTHN_FAILURE),
        }
    }
}

/// Retry hint of a request the transport gate refused (connection or
/// in-flight caps): long enough for a queue of timed-out requests to drain.
pub const GATE_PUSHBACK: Duration = Duration::from_secs(1);

/// Metadata key of the retry hint grpc-go honours.
pub const RETRY_PUSHBACK: &str = "grpc-retry-pushback-ms";

/// A shed request: RESOURCE_EXHAUSTED with the retry hint both as
/// `grpc-retry-pushback-ms` and as a `google.rpc.RetryInfo` detail. The
/// message is opaque (the reason is in the audit log).
pub fn shed_status(shed: &crate::admission::Shed) -> Status {
    pushback_status(shed.retry_after)
}

/// RESOURCE_EXHAUSTED with `retry_after` as pushback and RetryInfo.
pub fn pushback_status(retry_after: Duration) -> Status {
    use tonic_types::{ErrorDetails, StatusExt};
    let mut meta = tonic::metadata::MetadataMap::new();
    let ms = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX);
    meta.insert(RETRY_PUSHBACK, tonic::metadata::MetadataValue::from(ms));
    Status::with_error_details_and_metadata(
        tonic::Code::ResourceExhausted,
        "server overloaded, retry later",
        ErrorDetails::with_retry_info(Some(retry_after)),
        meta,
    )
}

/// When the request reached the server (stamped by the request gate, before
/// any queueing), so admission measures the caller's deadline from there.
#[derive(Debug, Clone, Copy)]
pub struct Arrival(pub std::time::Instant);

/// The caller's deadline from `grpc-timeout`, if it sent a valid one.
pub fn grpc_timeout<T>(req: &Request<T>) -> Option<Duration> {
    req.metadata()
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(crate::admission::decide::parse_grpc_timeout)
}

/// [`decode_request_with`] under the default [`InputLimits`].
pub fn decode_request(msg: IstioCertificateRequest) -> Result<IssueRequest, RequestError> {
    decode_request_with(msg, &InputLimits::default())
}

/// Refuses metadata beyond the limits before anything reads it: too many
/// keys, a long key, or a long value (strings by their length, other values
/// by their encoded size). Errors carry sizes only, never the caller's bytes.
pub fn check_metadata(
    meta: Option<&prost_types::Struct>,
    limits: &InputLimits,
) -> Result<(), RequestError> {
    let Some(meta) = meta else { return Ok(()) };
    let max = limits.max_metadata_value_bytes;
    if meta.fields.len() > limits.max_metadata_keys {
        return Err(RequestError::MetadataTooManyKeys {
            count: meta.fields.len(),
            max: limits.max_metadata_keys,
        });
    }
    for (key, value) in &meta.fields {
        if key.len() > max {
            return Err(RequestError::MetadataKeyTooLarge {
                len: key.len(),
                max,
            });
        }
        let len = match &value.kind {
            Some(Kind::StringValue(s)) => s.len(),
            _ => value.encoded_len(),
        };
        if len > max {
            return Err(if key == IMPERSONATED_IDENTITY {
                RequestError::ImpersonatedIdentityTooLarge { len, max }
            } else {
                RequestError::MetadataValueTooLarge { len, max }
            });
        }
    }
    Ok(())
}

/// Decodes the request message. Empty strings count as absent (the
/// istio-agent always sends `CertSigner: ""`); a non-string value is refused
/// rather than silently ignored; oversized metadata is refused first.
pub fn decode_request_with(
    msg: IstioCertificateRequest,
    limits: &InputLimits,
) -> Result<IssueRequest, RequestError> {
    check_metadata(msg.metadata.as_ref(), limits)?;
    // Returns the non-empty string value of `key`, refusing other types.
    let string = |key: &'static str| -> Result<Option<String>, RequestError> {
        let value = msg
            .metadata
            .as_ref()
            .and_then(|m| m.fields.get(key))
            .and_then(|v| v.kind.as_ref());
        match value {
            None | Some(Kind::NullValue(_)) => Ok(None),
            Some(Kind::StringValue(s)) => Ok(Some(s.clone()).filter(|s| !s.is_empty())),
            Some(_) => Err(RequestError::MetadataWrongType(key)),
        }
    };
    let impersonate = string(IMPERSONATED_IDENTITY)?;
    // Read only to validate its type: the built-in signer is the only one.
    string(CERT_SIGNER)?;
    Ok(IssueRequest {
        csr: msg.csr,
        validity_secs: msg.validity_duration,
        impersonate,
    })
}

/// Reads credentials from the connection and headers. An oversized token or
/// `clusterid` is not copied: it is dropped and recorded in `refused`, so
/// authentication fails before any TokenReview.
pub fn credentials<T>(req: &Request<T>, limits: &InputLimits) -> Credentials {
    let conn = req.extensions().get::<ConnInfo>();
    let meta = req.metadata();
    let mut refused = None;
    let bearer = meta
        .get_all("authorization")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(|v| v.strip_prefix("Bearer "));
    let bearer = match bearer {
        Some(t) if t.len() > limits.max_token_bytes => {
            refused = Some(AuthnError::TokenTooLarge {
                len: t.len(),
                max: limits.max_token_bytes,
            });
            None
        }
        t => t.map(str::to_string),
    };
    let cluster_ids: Vec<_> = meta.get_all("clusterid").iter().collect();
    let cluster_id = match cluster_ids.as_slice() {
        [one] if one.len() > limits.max_cluster_id_bytes => {
            refused.get_or_insert(AuthnError::ClusterIdTooLarge {
                len: one.len(),
                max: limits.max_cluster_id_bytes,
            });
            None
        }
        [one] => one.to_str().ok().map(str::to_string),
        _ => None,
    };
    Credentials {
        peer_addr: conn.map(|c| c.remote_addr),
        peer_chain: conn.and_then(|c| c.peer_chain.clone()),
        peer_leaf: conn.and_then(|c| c.peer_leaf.clone()),
        bearer,
        cluster_id,
        refused,
    }
}

/// The tonic service.
#[derive(Debug, Clone)]
pub struct CaService {
    issuer: Arc<CertificateIssuer>,
    limits: InputLimits,
}

impl CaService {
    pub fn new(issuer: Arc<CertificateIssuer>) -> Self {
        Self::with_limits(issuer, InputLimits::default())
    }

    pub fn with_limits(issuer: Arc<CertificateIssuer>, limits: InputLimits) -> Self {
        Self { issuer, limits }
    }

    /// tonic checks the declared length before buffering a message, so the
    /// limit also bounds what an unauthenticated stream can make us hold.
    pub fn into_server(self) -> IstioCertificateServiceServer<Self> {
        let max = self.limits.max_message_bytes;
        IstioCertificateServiceServer::new(self).max_decoding_message_size(max)
    }
}

#[tonic::async_trait]
impl IstioCertificateService for CaService {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        let creds = credentials(&request, &self.limits);
        let timing = crate::issue::Timing {
            arrived: request
                .extensions()
                .get::<Arrival>()
                .map_or_else(std::time::Instant::now, |a| a.0),
            timeout: grpc_timeout(&request),
        };
        let req = decode_request_with(request.into_inner(), &self.limits);
        let cert_chain = self.issuer.issue_within(&creds, req, timing).await?;
        Ok(Response::new(IstioCertificateResponse { cert_chain }))
    }
}

/// Puts the request gate ([`crate::transport::gate`]) in front of tonic's
/// routes and answers its refusals as grpc-go (istiod) does.
#[derive(Debug, Clone)]
pub struct RequestGateLayer {
    gate: Arc<RequestGate>,
    /// The sized share of streams in progress per connection (admission).
    concurrency: Option<Arc<crate::admission::Concurrency>>,
    /// Largest message: an unauthenticated stream's is read by the gate.
    max_message_bytes: usize,
}

impl RequestGateLayer {
    pub fn new(
        limits: &TransportLimits,
        input: &InputLimits,
        metrics: Option<Arc<TransportMetrics>>,
        aggregator: Option<Arc<crate::audit::aggregate::Aggregator>>,
    ) -> Self {
        Self {
            gate: Arc::new(RequestGate::new(limits, metrics, aggregator)),
            concurrency: None,
            max_message_bytes: input.max_message_bytes,
        }
    }

    /// Enforces admission's sized share of streams in progress per
    /// connection: a stream beyond it is refused before its message is read.
    pub fn with_concurrency(mut self, c: Arc<crate::admission::Concurrency>) -> Self {
        self.concurrency = Some(c);
        self
    }
}

/// Counts a gate refusal and answers it with the code grpc-go (istiod) gives
/// for the same condition.
fn refuse(
    gate: &RequestGate,
    r: Refusal,
    ip: Option<std::net::IpAddr>,
) -> http::Response<tonic::body::Body> {
    gate.count(r, ip);
    match r {
        Refusal::RequestTimeout => Status::deadline_exceeded("request timed out"),
        Refusal::MessageTooLarge => {
            Status::resource_exhausted("grpc: received message larger than max")
        }
        // Every slot or queue place is taken: a shed, with a hint.
        _ => pushback_status(GATE_PUSHBACK),
    }
    .into_http()
}

impl<S> tower_layer::Layer<S> for RequestGateLayer {
    type Service = RequestGateService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RequestGateService {
            inner,
            gate: self.gate.clone(),
            concurrency: self.concurrency.clone(),
            max_message_bytes: self.max_message_bytes,
        }
    }
}

#[derive(Debug, Clone)]
pub struct RequestGateService<S> {
    inner: S,
    gate: Arc<RequestGate>,
    concurrency: Option<Arc<crate::admission::Concurrency>>,
    max_message_bytes: usize,
}

/// Counts the request as cancelled by the client if dropped before it
/// finished (hyper drops it on RST_STREAM).
struct CancelGuard {
    control: Option<Arc<crate::transport::ConnControl>>,
    gate: Arc<RequestGate>,
    ip: Option<std::net::IpAddr>,
    done: bool,
}

impl CancelGuard {
    fn cancelled(&mut self) {
        self.done = true;
        if let Some(c) = &self.control {
            self.gate.stream_cancelled(c, self.ip);
        }
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.done {
            self.cancelled();
        }
    }
}

/// Counts a request in progress on its connection until dropped.
struct InProgress {
    control: Arc<crate::transport::ConnControl>,
    concurrency: Arc<crate::admission::Concurrency>,
}

impl InProgress {
    /// Takes a place among the connection's streams in progress, or `None`
    /// when it waited `limit`. Over the connection's share the stream waits,
    /// holding only its headers, for a place another of its streams frees.
    /// Under overload (the signing queue sheds work) only a stream younger
    /// than the fresh age takes a freed place; an older one waits out the
    /// park time and is refused ([`crate::admission::decide::park_step`]).
    /// Without overload (a burst the server works through in time) it waits
    /// its turn up to `limit`.
    async fn enter(
        control: Arc<crate::transport::ConnControl>,
        concurrency: Arc<crate::admission::Concurrency>,
        limit: Duration,
    ) -> Option<Self> {
        use crate::admission::decide::{park_step, ParkStep};
        let start = tokio::time::Instant::now();
        let end = start + limit;
        let park_end = start + concurrency.park().min(limit);
        let mut first_look = true;
        // Taken once the first look finds no place: the stream waits.
        let mut ticket: Option<crate::transport::WaitTicket> = None;
        let before = loop {
            let freed = control.freed();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let now = tokio::time::Instant::now();
            let overloaded = concurrency.overloaded();
            match park_step(
                now.duration_since(start),
                first_look,
                overloaded,
                concurrency.fresh(),
                ticket.as_ref().is_none_or(|t| t.is_newest()),
            ) {
                ParkStep::WaitOut => {
                    drop(ticket);
                    tokio::time::sleep_until(park_end).await;
                    return None;
                }
                ParkStep::Yield => {}
                ParkStep::TryPlace => {
                    if let Some(before) = control.try_stream_start(|n| concurrency.admits(n)) {
                        break before;
                    }
                }
            }
            if ticket.is_none() {
                ticket = Some(control.wait_ticket());
                concurrency.gate_waited();
            }
            first_look = false;
            if limit.is_zero() || concurrency.park().is_zero() {
                return None;
            }
            if (overloaded && now >= park_end) || now >= end {
                return None;
            }
            // Look again at least every park time: overload may begin.
            let until = if overloaded {
                park_end
            } else {
                end.min(now + concurrency.park())
            };
            let _ = tokio::time::timeout_at(until, freed).await;
        };
        concurrency.opened(before);
        Some(Self {
            control,
            concurrency,
        })
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        self.concurrency.closed(self.control.stream_ended());
    }
}

/// A request body that notes whether reading it failed.
struct WatchedBody {
    inner: tonic::body::Body,
    failed: Arc<std::sync::atomic::AtomicBool>,
}

impl http_body::Body for WatchedBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Err(_))) = &r {
            self.failed.store(true, Ordering::Release);
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

type B = tonic::body::Body;

impl<S> tower_service::Service<http::Request<B>> for RequestGateService<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        req.extensions_mut()
            .insert(Arrival(std::time::Instant::now()));
        let gate = self.gate.clone();
        let conn = req.extensions().get::<ConnInfo>();
        let ip = conn.map(|c| c.remote_addr.ip());
        let class = conn.map_or(AuthClass::Unauthenticated, ConnInfo::class);
        // The connection's share of streams in progress: taken before
        // anything else on an authenticated connection (a stream over it
        // costs its headers only), and only once the message is in on an
        // unauthenticated one.
        let share = match (&self.concurrency, conn) {
            (Some(c), Some(conn)) => {
                let timeout = req
                    .headers()
                    .get("grpc-timeout")
                    .and_then(|v| v.to_str().ok())
                    .and_then(crate::admission::decide::parse_grpc_timeout);
                Some((conn.control.clone(), c.clone(), c.wait_limit(timeout)))
            }
            _ => None,
        };
        let cancel = CancelGuard {
            control: conn.map(|c| c.control.clone()),
            gate: gate.clone(),
            ip,
            done: false,
        };
        // The ready service handles this call; a fresh clone takes its place.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let max_message = self.max_message_bytes;
        Box::pin(async move {
            // Moved whole into the future: dropped with it on RST_STREAM.
            let mut cancel = cancel;
            let result = match class {
                AuthClass::Authenticated => {
                    authenticated(req, share, &gate, ip, inner, &mut cancel).await
                }
                AuthClass::Unauthenticated => {
                    unauthenticated(req, share, &gate, ip, inner, &mut cancel, max_message).await
                }
            };
            cancel.done = true;
            result
        })
    }
}

/// The connection's place among its streams in progress, if admission sizes
/// one: `Err` is the refusal to send.
async fn enter_share(
    share: Option<Share>,
    gate: &RequestGate,
    ip: Option<std::net::IpAddr>,
    cancel: &mut CancelGuard,
) -> Result<Option<InProgress>, http::Response<tonic::body::Body>> {
    let Some((control, c, wait)) = share else {
        return Ok(None);
    };
    match InProgress::enter(control, c, wait).await {
        Some(p) => Ok(Some(p)),
        None => {
            cancel.done = true;
            Err(refuse(gate, Refusal::ConnectionStreamLimit, ip))
        }
    }
}

type Share = (
    Arc<crate::transport::ConnControl>,
    Arc<crate::admission::Concurrency>,
    Duration,
);

/// Calls the routes with `req`; answers an over-limit message (tonic's
/// OUT_OF_RANGE, which our handler never uses) as the gate's refusal, and
/// counts a message the client broke off as a cancellation.
async fn call_routes<S>(
    mut inner: S,
    req: http::Request<B>,
    gate: &RequestGate,
    ip: Option<std::net::IpAddr>,
    cancel: &mut CancelGuard,
) -> Result<http::Response<tonic::body::Body>, S::Error>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    let body_failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failed = body_failed.clone();
    let req = req.map(|inner| B::new(WatchedBody { inner, failed }));
    let resp = inner.call(req).await?;
    if body_failed.load(Ordering::Acquire) {
        // The client reset the stream (or the connection broke)
        // mid-message: tonic answered without our handler.
        cancel.cancelled();
    }
    if Status::from_header_map(resp.headers()).map(|s| s.code()) == Some(tonic::Code::OutOfRange) {
        return Ok(refuse(gate, Refusal::MessageTooLarge, ip));
    }
    Ok(resp)
}

/// A stream on a connection with a verified client certificate: its
/// connection's share, a gate slot (its address's authenticated share),
/// then the routes read its message, all within the request timeout.
async fn authenticated<S>(
    req: http::Request<B>,
    share: Option<Share>,
    gate: &RequestGate,
    ip: Option<std::net::IpAddr>,
    inner: S,
    cancel: &mut CancelGuard,
) -> Result<http::Response<tonic::body::Body>, S::Error>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    let _in_progress = match enter_share(share, gate, ip, cancel).await {
        Ok(p) => p,
        Err(refused) => return Ok(refused),
    };
    let work = async {
        let _slot = match gate.slot(ip, AuthClass::Authenticated).await {
            Ok(s) => s,
            Err(r) => return Ok(refuse(gate, r, ip)),
        };
        call_routes(inner, req, gate, ip, cancel).await
    };
    match tokio::time::timeout(gate.timeout(), work).await {
        Ok(r) => r,
        Err(_) => Ok(refuse(gate, Refusal::RequestTimeout, ip)),
    }
}

/// A stream on a connection without a verified client certificate (token
/// callers included: their token is verified only after the message). It
/// takes a gate slot from its class's part and its address's
/// unauthenticated share, and must have sent its whole message within the
/// body timeout of its headers (else it is reset,
/// `unauthenticated_body_timeout`); only then does it take a place in its
/// connection's share of the signing capacity and reach the routes. A
/// stream that declares a message and never sends it thus holds neither
/// the authenticated callers' slots nor the signing share, and nothing for
/// longer than the body timeout.
async fn unauthenticated<S>(
    req: http::Request<B>,
    share: Option<Share>,
    gate: &RequestGate,
    ip: Option<std::net::IpAddr>,
    inner: S,
    cancel: &mut CancelGuard,
    max_message: usize,
) -> Result<http::Response<tonic::body::Body>, S::Error>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    let body_by =
        (!gate.body_timeout().is_zero()).then(|| tokio::time::Instant::now() + gate.body_timeout());
    let work = async {
        let (parts, body) = req.into_parts();
        let read = async {
            let slot = gate.slot(ip, AuthClass::Unauthenticated).await?;
            Ok::<_, Refusal>((slot, read_message(body, max_message).await))
        };
        let read = match body_by {
            Some(at) => tokio::time::timeout_at(at, read)
                .await
                .unwrap_or(Err(Refusal::UnauthenticatedBodyTimeout)),
            None => read.await,
        };
        let (_slot, message) = match read {
            Ok(r) => r,
            Err(r) => return Ok(refuse(gate, r, ip)),
        };
        let message = match message {
            Ok(m) => m,
            Err(BodyRead::TooLarge) => return Ok(refuse(gate, Refusal::MessageTooLarge, ip)),
            Err(BodyRead::Failed) => {
                cancel.cancelled();
                return Ok(Status::cancelled("the request body broke off").into_http());
            }
        };
        let _in_progress = match enter_share(share, gate, ip, cancel).await {
            Ok(p) => p,
            Err(refused) => return Ok(refused),
        };
        let req = http::Request::from_parts(parts, B::new(Buffered(Some(message))));
        call_routes(inner, req, gate, ip, cancel).await
    };
    match tokio::time::timeout(gate.timeout(), work).await {
        Ok(r) => r,
        Err(_) => Ok(refuse(gate, Refusal::RequestTimeout, ip)),
    }
}

/// Why an unauthenticated stream's message could not be taken in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyRead {
    /// Declared or sent beyond the largest message.
    TooLarge,
    /// The client reset the stream or the connection broke.
    Failed,
}

/// Reads a request body to its end, at most one gRPC frame of
/// `max_message` bytes (its 5-byte prefix declaring more is refused as soon
/// as the prefix is in, as tonic's decoder does).
async fn read_message(mut body: B, max_message: usize) -> Result<bytes::Bytes, BodyRead> {
    use http_body::Body as _;
    const PREFIX: usize = 5;
    let cap = max_message.saturating_add(PREFIX);
    let mut buf = bytes::BytesMut::new();
    loop {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        let Some(frame) = frame else {
            return Ok(buf.freeze());
        };
        let Ok(data) = frame.map_err(|_| BodyRead::Failed)?.into_data() else {
            // Trailers: a gRPC request carries none that matter.
            continue;
        };
        if buf.len().saturating_add(data.len()) > cap {
            return Err(BodyRead::TooLarge);
        }
        buf.extend_from_slice(&data);
        if let Some(len) = declared_len(&buf) {
            if len > max_message {
                return Err(BodyRead::TooLarge);
            }
        }
    }
}

/// The message length a gRPC frame's prefix declares, once it is in.
fn declared_len(buf: &[u8]) -> Option<usize> {
    let len: [u8; 4] = buf.get(1..5)?.try_into().ok()?;
    usize::try_from(u32::from_be_bytes(len)).ok()
}

/// A request body the gate has already read whole.
struct Buffered(Option<bytes::Bytes>);

impl http_body::Body for Buffered {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Poll::Ready(self.0.take().map(|b| Ok(http_body::Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.0.as_ref().map_or(0, |b| b.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::string_value;
    use test_case::test_case;

    /// Every refusal that asks the caller to come back later carries the
    /// hint both ways: the budget's own, admission's, and the gate's.
    #[test]
    fn overload_refusals_carry_pushback_and_retry_info() {
        use tonic_types::StatusExt;
        let budget = Status::from(IssueError::Unauthenticated(AuthnError::Overloaded {
            reason: "authn_tokenreview_rate_limited",
            detail: "budget".into(),
            retry_after: Duration::from_millis(750),
        }));
        let gate = pushback_status(GATE_PUSHBACK);
        for (st, ms) in [(budget, 750u64), (gate, 1000)] {
            assert_eq!(st.code(), tonic::Code::ResourceExhausted);
            assert_eq!(
                st.metadata()
                    .get(RETRY_PUSHBACK)
                    .and_then(|v| v.to_str().ok()),
                Some(ms.to_string().as_str())
            );
            let info = st.get_details_retry_info().expect("RetryInfo");
            assert_eq!(info.retry_delay, Some(Duration::from_millis(ms)));
            // Opaque to the client: the reason stays in the audit log.
            assert!(!st.message().contains("budget"));
        }
        // A plain TokenReview outage stays Unavailable, as istiod.
        let outage = Status::from(IssueError::Unauthenticated(AuthnError::Unavailable(
            "down".into(),
        )));
        assert_eq!(outage.code(), tonic::Code::Unavailable);
    }

    fn limits() -> InputLimits {
        InputLimits {
            max_message_bytes: 128 * 1024,
            max_token_bytes: 100,
            max_cluster_id_bytes: 10,
            max_metadata_value_bytes: 20,
            max_metadata_keys: 3,
        }
    }

    fn msg(fields: &[(&str, prost_types::Value)]) -> IstioCertificateRequest {
        IstioCertificateRequest {
            csr: "csr".into(),
            validity_duration: 0,
            metadata: Some(prost_types::Struct {
                fields: fields
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.clone()))
                    .collect(),
            }),
        }
    }

    fn list_value(n: usize) -> prost_types::Value {
        prost_types::Value {
            kind: Some(Kind::ListValue(prost_types::ListValue {
                values: vec![string_value("x"); n],
            })),
        }
    }

    #[test_case(&[(IMPERSONATED_IDENTITY, string_value(&"a".repeat(21)))], "impersonated_identity_too_large" ; "long impersonation")]
    #[test_case(&[(CERT_SIGNER, string_value(&"a".repeat(21)))], "metadata_value_too_large" ; "long signer")]
    #[test_case(&[("other", list_value(10))], "metadata_value_too_large" ; "big non string value")]
    #[test_case(&[(&"k".repeat(21), string_value(""))], "metadata_key_too_large" ; "long key")]
    #[test_case(&[("a", string_value("")), ("b", string_value("")), ("c", string_value("")), ("d", string_value(""))], "metadata_too_many_keys" ; "too many keys")]
    #[test_case(&[(IMPERSONATED_IDENTITY, list_value(1))], "metadata_wrong_type" ; "wrong type still refused")]
    fn refuses_oversized_metadata(fields: &[(&str, prost_types::Value)], reason: &str) {
        let err = decode_request_with(msg(fields), &limits()).unwrap_err();
        assert_eq!(err.reason(), reason);
        // The message never carries the caller's bytes.
        assert!(!err.to_string().contains("aaaa") && !err.to_string().contains("kkkk"));
        let status = Status::from(IssueError::Request(err));
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
    }

    #[test_case(&[(IMPERSONATED_IDENTITY, string_value(&"a".repeat(20)))] ; "impersonation at the limit")]
    #[test_case(&[("a", string_value("")), ("b", string_value("")), ("c", string_value(""))] ; "keys at the limit")]
    #[test_case(&[] ; "no metadata")]
    fn accepts_metadata_within_limits(fields: &[(&str, prost_types::Value)]) {
        decode_request_with(msg(fields), &limits()).unwrap();
    }

    fn request(headers: &[(&'static str, String)]) -> Request<()> {
        let mut r = Request::new(());
        for (k, v) in headers {
            r.metadata_mut().append(*k, v.parse().unwrap());
        }
        r
    }

    #[test_case(&[("authorization", format!("Bearer {}", "t".repeat(101)))], Some("authn_token_too_large") ; "long token")]
    #[test_case(&[("authorization", format!("Bearer {}", "t".repeat(100)))], None ; "token at the limit")]
    #[test_case(&[("clusterid", "c".repeat(11))], Some("authn_clusterid_too_large") ; "long clusterid")]
    #[test_case(&[("clusterid", "c".repeat(10))], None ; "clusterid at the limit")]
    fn bounds_credential_headers(headers: &[(&'static str, String)], refused: Option<&str>) {
        let creds = credentials(&request(headers), &limits());
        assert_eq!(creds.refused.as_ref().map(|e| e.reason()), refused);
        if refused.is_some() {
            // Nothing of the oversized value is kept.
            assert!(creds.bearer.is_none() && creds.cluster_id.is_none());
            let status = Status::from(IssueError::Unauthenticated(creds.refused.unwrap()));
            assert_eq!(status.code(), tonic::Code::Unauthenticated);
            assert_eq!(status.message(), AUTHN_FAILURE);
        }
    }

    #[tokio::test]
    async fn a_refused_credential_fails_authentication_before_the_token_authenticator() {
        #[derive(Debug)]
        struct Panics;
        #[tonic::async_trait]
        impl crate::authn::TokenAuthenticator for Panics {
            async fn authenticate(
                &self,
                _: &str,
                _: Option<&str>,
            ) -> Result<crate::authn::Caller, AuthnError> {
                panic!("the token authenticator must not be called")
            }
        }
        let creds = credentials(
            &request(&[
                ("authorization", format!("Bearer {}", "t".repeat(50))),
                ("clusterid", "c".repeat(11)),
            ]),
            &limits(),
        );
        let err = crate::authn::authenticate(&creds, Some(&Panics))
            .await
            .unwrap_err();
        assert_eq!(err.reason(), "authn_clusterid_too_large");
    }

    /// The request gate's park under overload, on its own code path (real
    /// admission queue, real connection counter, real clock): a stream over
    /// its connection's share takes a place freed within the fresh age (the
    /// newest waiting one first), and one past the fresh age takes none and
    /// is refused at the end of its park time (new work first).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn under_overload_the_newest_parked_stream_takes_a_freed_place_and_none_past_the_fresh_age(
    ) {
        use crate::admission::{Admission, AdmissionConfig, ShedReason};
        use std::time::Instant;
        let a = Arc::new(Admission::new(
            AdmissionConfig {
                max_running: 1,
                max_queued: 1,
                sign_inline: false,
                // Fresh age: a quarter of the target, 500 ms.
                queue_target: Duration::from_secs(2),
                stream_park: Duration::from_millis(1500),
                max_streams_per_connection: 1,
                ..Default::default()
            },
            None,
        ));
        let later = Instant::now() + Duration::from_secs(60);
        // Overload: the one signing thread held, one request waiting, the next shed.
        let (release, rx) = std::sync::mpsc::channel::<()>();
        let held = tokio::spawn({
            let a = a.clone();
            async move {
                a.run("held", Instant::now(), later, move || {
                    let _ = rx.recv();
                })
                .await
            }
        });
        while a.stats().0 < 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.run("waiting", Instant::now(), later, || ()).await }
        });
        while a.stats().1 < 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let shed = || async {
            let r = a.run("shed", Instant::now(), later, || ()).await;
            assert_eq!(r.err().map(|s| s.reason), Some(ShedReason::QueueFull));
        };
        shed().await;
        let c = a.concurrency();
        assert!(c.overloaded());
        assert_eq!(c.fresh(), Duration::from_millis(500));

        let conn = crate::transport::ConnControl::new(200);
        let limit = Duration::from_secs(5);
        // A stream that starts waiting for a place, given 20 ms to do so
        // (its handle is returned, to be awaited later).
        #[allow(clippy::async_yields_async)]
        let wait = || {
            let task = tokio::spawn(InProgress::enter(conn.clone(), c.clone(), limit));
            async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                task
            }
        };
        let placed = |task: tokio::task::JoinHandle<Option<InProgress>>, why: &'static str| async move {
            task.await.unwrap().expect(why)
        };
        // Within the fresh age: the place its connection frees is taken.
        let first = InProgress::enter(conn.clone(), c.clone(), limit)
            .await
            .expect("a free place");
        let parked = wait().await;
        assert!(!parked.is_finished(), "over its share, the stream waits");
        drop(first);
        let second = placed(parked, "a place freed within the fresh age is taken").await;

        // Within the fresh age the newest waiting stream takes a freed
        // place; the older one takes the next.
        let older = wait().await;
        let newer = wait().await;
        shed().await;
        drop(second);
        let second = placed(newer, "the newest waiting stream takes the freed place").await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!older.is_finished(), "the older stream took the place");
        drop(second);
        let second = placed(older, "the older stream, still fresh, takes the next place").await;

        // Past the fresh age: the freed place is left to newer work.
        let started = Instant::now();
        let parked = tokio::spawn(InProgress::enter(conn.clone(), c.clone(), limit));
        tokio::time::sleep(Duration::from_millis(600)).await;
        shed().await; // still overloaded when the place is freed
        drop(second);
        let got = parked.await.unwrap();
        assert!(
            got.is_none(),
            "a stream past the fresh age took a freed place under overload"
        );
        assert!(started.elapsed() >= Duration::from_millis(1500));
        // The place it did not take is free for a new stream.
        assert!(InProgress::enter(conn.clone(), c.clone(), limit)
            .await
            .is_some());

        drop(release);
        assert!(held.await.unwrap().is_ok());
        assert!(waiting.await.unwrap().is_ok());
    }

    /// A body that sends `first` (if any) and then nothing, never ending.
    struct Stalled(Option<bytes::Bytes>);

    impl http_body::Body for Stalled {
        type Data = bytes::Bytes;
        type Error = tonic::Status;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
            match self.0.take() {
                Some(b) => Poll::Ready(Some(Ok(http_body::Frame::data(b)))),
                None => Poll::Pending,
            }
        }
    }

    /// Routes that note how many connections held a place in the signing
    /// share when they were reached, then answer OK.
    #[derive(Clone)]
    struct Noting {
        concurrency: Arc<crate::admission::Concurrency>,
        busy: Arc<std::sync::Mutex<Vec<usize>>>,
    }

    impl tower_service::Service<http::Request<B>> for Noting {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<Self::Response, Self::Error>>;
        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _req: http::Request<B>) -> Self::Future {
            self.busy
                .lock()
                .unwrap()
                .push(self.concurrency.busy_connections());
            std::future::ready(Ok(Status::ok("").into_http()))
        }
    }

    /// A stream without a client certificate takes no place in its
    /// connection's share of the signing capacity while its message is
    /// missing, and is refused at the body timeout (RESOURCE_EXHAUSTED,
    /// never reaching the routes); one whose message is in takes its place
    /// and reaches them.
    #[tokio::test]
    async fn an_unauthenticated_stream_takes_no_signing_share_until_its_message_is_in() {
        use crate::admission::{Admission, AdmissionConfig};
        use tower_layer::Layer as _;
        use tower_service::Service as _;
        let a = Admission::new(AdmissionConfig::default(), None);
        let limits = TransportLimits {
            unauthenticated_body_timeout: Duration::from_millis(300),
            ..TransportLimits::default()
        };
        let busy = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut svc = RequestGateLayer::new(&limits, &InputLimits::default(), None, None)
            .with_concurrency(a.concurrency())
            .layer(Noting {
                concurrency: a.concurrency(),
                busy: busy.clone(),
            });
        let conn = ConnInfo {
            remote_addr: "10.0.0.1:4000".parse().unwrap(),
            peer_chain: None,
            peer_leaf: None,
            control: crate::transport::ConnControl::new(200),
        };
        assert_eq!(conn.class(), AuthClass::Unauthenticated);
        let request = |body: B| {
            let mut r = http::Request::new(body);
            r.extensions_mut().insert(conn.clone());
            r
        };
        // A prefix declaring 100 bytes, then 10 of them, then nothing.
        let mut partial = vec![0u8, 0, 0, 0, 100];
        partial.extend_from_slice(&[0u8; 10]);
        let t = std::time::Instant::now();
        let stalled = tokio::spawn(svc.call(request(B::new(Stalled(Some(partial.into()))))));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(a.concurrency().busy_connections(), 0);
        let resp = stalled.await.unwrap().unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(
            Status::from_header_map(resp.headers()).map(|s| s.code()),
            Some(tonic::Code::ResourceExhausted)
        );
        assert!(busy.lock().unwrap().is_empty(), "the routes were reached");
        // A whole message: read, a place taken, the routes reached.
        let whole = bytes::Bytes::from_static(&[0, 0, 0, 0, 2, 8, 1]);
        let resp = svc
            .call(request(B::new(Buffered(Some(whole)))))
            .await
            .unwrap();
        assert_eq!(
            Status::from_header_map(resp.headers()).map(|s| s.code()),
            Some(tonic::Code::Ok)
        );
        assert_eq!(*busy.lock().unwrap(), vec![1]);
        assert_eq!(a.concurrency().busy_connections(), 0);
        // A prefix declaring more than the largest message is refused at once.
        let t = std::time::Instant::now();
        let mut big = vec![0u8];
        big.extend_from_slice(&(4u32 << 20).to_be_bytes());
        let resp = svc
            .call(request(B::new(Stalled(Some(big.into())))))
            .await
            .unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(250),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(
            Status::from_header_map(resp.headers()).map(|s| s.code()),
            Some(tonic::Code::ResourceExhausted)
        );
        assert_eq!(busy.lock().unwrap().len(), 1);
    }
}
