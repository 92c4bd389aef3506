//! The gRPC surface: `istio.v1.auth.IstioCertificateService` over TLS. The only
//! module that knows `tonic::Status`.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use prost_types::value::Kind;
use rustls_pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::Connected;
use tonic::{Request, Response, Status};

use crate::authn::Credentials;
use crate::ca::TtlError;
use crate::issue::{CertificateIssuer, IssueError, IssueRequest, RequestError};
use crate::proto::istio_certificate_service_server::{
    IstioCertificateService, IstioCertificateServiceServer,
};
use crate::proto::{IstioCertificateRequest, IstioCertificateResponse};
use crate::tls::ServingTls;

/// Metadata key a node proxy uses to ask for another workload's identity.
pub const IMPERSONATED_IDENTITY: &str = "ImpersonatedIdentity";
/// Metadata key selecting a signer; accepted and ignored (as istiod's built-in CA).
pub const CERT_SIGNER: &str = "CertSigner";
/// Largest gRPC message accepted (istiod: 4 MiB; a CSR is capped at 64 KiB anyway).
const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Opaque messages, as istiod: the precise reason is only in the audit log.
const AUTHN_FAILURE: &str = "request authenticate failure";
const IMPERSONATION_FAILURE: &str = "request impersonation authentication failure";

impl From<IssueError> for Status {
    fn from(err: IssueError) -> Self {
        match err {
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
            IssueError::Sign(e) => Status::internal(format!("CSR signing error ({e})")),
            IssueError::Audit(_) => Status::internal("CSR signing error (audit log unavailable)"),
        }
    }
}

/// Decodes the request message. Empty strings count as absent (the
/// istio-agent always sends `CertSigner: ""`); a non-string value is refused
/// rather than silently ignored.
pub fn decode_request(msg: IstioCertificateRequest) -> Result<IssueRequest, RequestError> {
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

/// Reads credentials from the connection and headers.
pub fn credentials<T>(req: &Request<T>) -> Credentials {
    let conn = req.extensions().get::<ConnInfo>();
    let meta = req.metadata();
    let bearer = meta
        .get_all("authorization")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(|v| v.strip_prefix("Bearer "))
        .map(str::to_string);
    let cluster_ids: Vec<_> = meta.get_all("clusterid").iter().collect();
    let cluster_id = match cluster_ids.as_slice() {
        [one] => one.to_str().ok().map(str::to_string),
        _ => None,
    };
    Credentials {
        peer_addr: conn.map(|c| c.remote_addr),
        peer_chain: conn.and_then(|c| c.peer_chain.clone()),
        bearer,
        cluster_id,
    }
}

/// The tonic service.
#[derive(Debug, Clone)]
pub struct CaService {
    issuer: Arc<CertificateIssuer>,
}

impl CaService {
    pub fn new(issuer: Arc<CertificateIssuer>) -> Self {
        Self { issuer }
    }

    pub fn into_server(self) -> IstioCertificateServiceServer<Self> {
        IstioCertificateServiceServer::new(self).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }
}

#[tonic::async_trait]
impl IstioCertificateService for CaService {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        let creds = credentials(&request);
        let req = decode_request(request.into_inner());
        let cert_chain = self.issuer.issue(&creds, req).await?;
        Ok(Response::new(IstioCertificateResponse { cert_chain }))
    }
}

/// What a connection carries into each request's extensions.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub remote_addr: SocketAddr,
    pub peer_chain: Option<Arc<[CertificateDer<'static>]>>,
}

/// A TLS connection handed to tonic.
pub struct TlsConn {
    inner: tokio_rustls::server::TlsStream<TcpStream>,
    info: ConnInfo,
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
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Accepts TCP connections and completes TLS handshakes off the accept loop;
/// yields finished connections. Handshake failures are logged, not fatal.
pub fn tls_incoming(
    listener: TcpListener,
    tls: Arc<ServingTls>,
) -> tokio_stream::wrappers::ReceiverStream<Result<TlsConn, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(128);
    tokio::spawn(async move {
        loop {
            let (tcp, remote_addr) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            if tx.is_closed() {
                return;
            }
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.current());
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let peer_chain = stream.get_ref().1.peer_certificates().map(|c| {
                            c.iter()
                                .map(|c| c.clone().into_owned())
                                .collect::<Vec<_>>()
                                .into()
                        });
                        let conn = TlsConn {
                            inner: stream,
                            info: ConnInfo {
                                remote_addr,
                                peer_chain,
                            },
                        };
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Ok(Err(e)) => {
                        tracing::info!(peer = %remote_addr, error = %e, "TLS handshake failed")
                    }
                    Err(_) => tracing::info!(peer = %remote_addr, "TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
