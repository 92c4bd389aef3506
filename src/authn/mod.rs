//! Caller authentication: who is asking, proven how.

pub mod args;
pub mod jwks;
pub mod local;
pub mod metrics;
pub mod mtls;
pub mod token;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;

use rustls_pki_types::CertificateDer;

use crate::identity::SpiffeId;

/// How a caller proved its identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AuthnMethod {
    Mtls,
    TokenReview,
    /// A projected token verified locally against the issuer's keys and the pod index.
    TokenLocal,
    /// A TokenReview after local verification could not decide (the reason
    /// code of [`local::LocalError`] that sent it there).
    TokenReviewAfterLocal(&'static str),
}

impl AuthnMethod {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Mtls => "mtls",
            Self::TokenReview | Self::TokenReviewAfterLocal(_) => "token-review",
            Self::TokenLocal => "token-local",
        }
    }

    /// Which path verified a token caller (`local` or `review`), for the audit record.
    pub fn token_verified_by(&self) -> Option<&'static str> {
        match self {
            Self::Mtls => None,
            Self::TokenReview | Self::TokenReviewAfterLocal(_) => Some("review"),
            Self::TokenLocal => Some("local"),
        }
    }

    /// Why local verification handed the token to TokenReview.
    pub fn local_fallback(&self) -> Option<&'static str> {
        match self {
            Self::TokenReviewAfterLocal(r) => Some(r),
            _ => None,
        }
    }
}

/// The pod a token was bound to, from the TokenReview's `user.extra`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct KubernetesInfo {
    pub pod_namespace: String,
    pub pod_name: String,
    pub pod_uid: String,
    pub service_account: String,
    /// Present on tokens minted for a scheduled pod (Kubernetes >= 1.30).
    pub node_name: Option<String>,
    /// The cluster whose API server or issuer keys verified the token (set
    /// by the cluster registry).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_id: Option<String>,
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub method: AuthnMethod,
    pub identity: SpiffeId,
    /// Only token callers carry pod information (as in istiod).
    pub kube: Option<KubernetesInfo>,
}

/// What the transport and headers offer as proof.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    pub peer_addr: Option<SocketAddr>,
    /// The client certificate chain, already verified during the handshake.
    pub peer_chain: Option<Arc<[CertificateDer<'static>]>>,
    /// `peer_chain[0]` parsed once per connection by the transport: a
    /// connection carries many requests, and parsing the certificate again
    /// for each was measurable. Absent, it is parsed from `peer_chain`.
    pub peer_leaf: Option<Arc<Result<mtls::Leaf, mtls::MtlsError>>>,
    /// `authorization: Bearer <token>`; never logged.
    pub bearer: Option<String>,
    /// The single `clusterid` header value, if exactly one was sent.
    pub cluster_id: Option<String>,
    /// A credential header refused while reading it (over its size limit):
    /// authentication fails with this before any other work.
    pub refused: Option<AuthnError>,
}

impl Credentials {
    /// The client certificate's leaf as requests need it: the transport's
    /// per-connection parse when there is one, else parsed from
    /// `peer_chain`. `None` without a client certificate.
    pub fn leaf(&self) -> Option<Result<std::borrow::Cow<'_, mtls::Leaf>, mtls::MtlsError>> {
        use std::borrow::Cow;
        let first = self.peer_chain.as_deref()?.first()?;
        Some(match self.peer_leaf.as_deref() {
            Some(cached) => cached.as_ref().map(Cow::Borrowed).map_err(Clone::clone),
            None => mtls::leaf_of(first, None).map(Cow::Owned),
        })
    }
}

/// Why authentication failed. The client only ever sees istiod's opaque
/// message; the reason goes to the audit log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthnError {
    #[error("no client certificate and no bearer token")]
    NoCredentials,
    #[error("client certificate: {0}")]
    ClientCert(#[from] mtls::MtlsError),
    #[error("bearer token presented but no token authenticator is configured")]
    TokenAuthnDisabled,
    #[error("token review: {0}")]
    Token(String, &'static str),
    #[error("token review unavailable: {0}")]
    Unavailable(String),
    /// Refused by meshca's own TokenReview budget before any review; the
    /// client should retry after `retry_after`.
    #[error("token review refused: {detail}")]
    Overloaded {
        reason: &'static str,
        detail: String,
        retry_after: std::time::Duration,
    },
    #[error("bearer token is {len} bytes, over the limit of {max}")]
    TokenTooLarge { len: usize, max: usize },
    #[error("clusterid header is {len} bytes, over the limit of {max}")]
    ClusterIdTooLarge { len: usize, max: usize },
    /// Refused by local token verification (see [`local::LocalError`]).
    #[error("local token verification: {0}")]
    Local(#[from] local::LocalError),
    /// The client certificate's serial is marked for a cluster meshca does
    /// not serve (removed, or never registered).
    #[error(
        "client certificate was issued for cluster tag {0}, which names no registered cluster"
    )]
    MtlsClusterUnknown(String),
    /// The `clusterid` header names another cluster than the one the client
    /// certificate was issued for.
    #[error("clusterid header names cluster {header:?}, the client certificate was issued for cluster {verified:?}")]
    MtlsClusterMismatch { header: String, verified: String },
    /// The client certificate was not signed by one of this deployment's
    /// signing certificates ([`crate::ca::own`]) and its serial names no
    /// registered remote cluster: its serial is no proof of any cluster.
    #[error("client certificate was signed by another CA under the mesh roots ({0})")]
    MtlsForeignIssuer(String),
    /// The revocation store has not been read yet: a client certificate
    /// cannot be checked against it.
    #[error("revocations not loaded yet")]
    RevocationsNotLoaded,
}

impl AuthnError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NoCredentials => "authn_no_credentials",
            Self::ClientCert(e) => e.reason(),
            Self::TokenAuthnDisabled => "authn_token_disabled",
            Self::Token(_, reason) => reason,
            Self::Unavailable(_) => "authn_tokenreview_unavailable",
            Self::Overloaded { reason, .. } => reason,
            Self::TokenTooLarge { .. } => "authn_token_too_large",
            Self::ClusterIdTooLarge { .. } => "authn_clusterid_too_large",
            Self::Local(e) => e.reason(),
            Self::MtlsClusterUnknown(_) => "mtls_cluster_unknown",
            Self::MtlsClusterMismatch { .. } => "mtls_cluster_mismatch",
            Self::MtlsForeignIssuer(_) => "mtls_foreign_issuer",
            Self::RevocationsNotLoaded => "revocations_not_loaded",
        }
    }

    /// Worth retrying: no verdict on the credentials was reached.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Unavailable(_) | Self::Overloaded { .. } | Self::RevocationsNotLoaded => true,
            Self::Local(e) => e.is_retryable(),
            _ => false,
        }
    }
}

/// Validates bearer tokens (the Kubernetes TokenReview implementation lives
/// in the kube module). Behind a trait so unit tests can use a fake.
#[tonic::async_trait]
pub trait TokenAuthenticator: Send + Sync + std::fmt::Debug {
    async fn authenticate(
        &self,
        token: &str,
        cluster_id: Option<&str>,
    ) -> Result<Caller, AuthnError>;

    /// What a cache (or the pre-check) would answer for `token` without a
    /// review: `Some(true)` a cached success, `Some(false)` a cached or
    /// certain rejection, `None` a review is needed. Cheap, and never an
    /// allow by itself: admission uses it to let known callers through first
    /// while overloaded and to budget only the requests that cost a review.
    fn cached_verdict(&self, _token: &str) -> Option<bool> {
        None
    }
}

/// Which issuer key signed a token, for the denylist's `token-key` entries
/// ([`crate::denylist`]): a token's header may name no key, or another one,
/// and the API server still accepts it (it tries every key when there is no
/// `kid`). Implemented over one issuer's keys ([`jwks::IssuerKeys`]) and
/// over every cluster's (`cluster::ClusterRegistry`). Behind a trait so the
/// use case and its tests need no Kubernetes.
#[tonic::async_trait]
pub trait TokenSigners: Send + Sync + std::fmt::Debug {
    /// The `kid` among `kids` whose key, as published by any issuer since
    /// start (kept after the issuer drops it), verifies `token`'s signature.
    fn signed_by_one_of(&self, token: &str, kids: &HashSet<String>) -> Option<String>;

    /// The `kid` of the key of `cluster`'s issuer (`None`: the local
    /// cluster) that signed `token`. `Err` says why no signer could be
    /// established.
    async fn signer(&self, token: &str, cluster: Option<&str>) -> Result<String, String>;
}

#[tonic::async_trait]
impl TokenSigners for jwks::IssuerKeys {
    fn signed_by_one_of(&self, token: &str, kids: &HashSet<String>) -> Option<String> {
        jwks::IssuerKeys::signed_by_one_of(self, token, kids)
    }

    async fn signer(&self, token: &str, _cluster: Option<&str>) -> Result<String, String> {
        self.signer_of(token).await
    }
}

/// How much an incoming request's authentication costs, decided before
/// any TokenReview.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Familiarity {
    /// A verified client certificate or a cached successful review.
    Known,
    /// Refused without a remote call (cached rejection, failed pre-check,
    /// oversized or missing credentials).
    RefusedCheaply,
    /// Needs a TokenReview.
    New,
}

/// Classifies a request's credentials without any remote call. Not an
/// authentication.
pub fn familiarity(creds: &Credentials, tokens: Option<&dyn TokenAuthenticator>) -> Familiarity {
    if creds.refused.is_some() {
        return Familiarity::RefusedCheaply;
    }
    if creds.peer_chain.as_deref().is_some_and(|c| !c.is_empty()) {
        return Familiarity::Known;
    }
    match (&creds.bearer, tokens) {
        (Some(t), Some(auth)) => match auth.cached_verdict(t) {
            Some(true) => Familiarity::Known,
            Some(false) => Familiarity::RefusedCheaply,
            None => Familiarity::New,
        },
        _ => Familiarity::RefusedCheaply,
    }
}

/// Authenticates a request like istiod: a client certificate wins over a
/// token (a caller sending both is identified by the certificate).
pub async fn authenticate(
    creds: &Credentials,
    tokens: Option<&dyn TokenAuthenticator>,
) -> Result<Caller, AuthnError> {
    if let Some(e) = &creds.refused {
        return Err(e.clone());
    }
    if let Some(leaf) = creds.leaf() {
        let leaf = leaf?;
        // The handshake checked validity once; a long-lived connection (or a
        // resumed session) must not carry an expired certificate further.
        if time::OffsetDateTime::now_utc().unix_timestamp() > leaf.not_after {
            return Err(mtls::MtlsError::Expired(leaf.not_after).into());
        }
        let identity = leaf.identity.clone();
        return Ok(Caller {
            method: AuthnMethod::Mtls,
            identity,
            kube: None,
        });
    }
    match (&creds.bearer, tokens) {
        (Some(token), Some(auth)) => auth.authenticate(token, creds.cluster_id.as_deref()).await,
        (Some(_), None) => Err(AuthnError::TokenAuthnDisabled),
        (None, _) => Err(AuthnError::NoCredentials),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::generate::KeyType;
    use crate::testing::{client_identity, mtls_credentials, TestPki};

    fn creds_for(secs_left: i64) -> Credentials {
        let pki = TestPki::new(KeyType::EcdsaP256);
        let bundle =
            crate::ca::CaBundle::load_dir(pki.path(), time::OffsetDateTime::now_utc()).unwrap();
        let now = time::OffsetDateTime::now_utc();
        let v = crate::ca::Validity {
            not_before: now - time::Duration::hours(1),
            not_after: now + time::Duration::seconds(secs_left),
            clamped: false,
        };
        let (chain, _) = client_identity(&bundle, "spiffe://cluster.local/ns/a/sa/b", &v);
        mtls_credentials(&chain)
    }

    /// The handshake's check is not enough: a connection (or anything that
    /// carries a verified chain) past notAfter is refused per request.
    #[tokio::test]
    async fn client_certificate_expiry_is_checked_per_request() {
        let ok = authenticate(&creds_for(60), None).await.unwrap();
        assert_eq!(ok.method, AuthnMethod::Mtls);
        let e = authenticate(&creds_for(-2), None).await.unwrap_err();
        assert_eq!(e.reason(), "mtls_cert_expired");
    }

    /// The connection's parsed leaf is what a request is judged by (the
    /// transport parses it once), and its expiry is still checked per request.
    #[tokio::test]
    async fn the_connections_parsed_leaf_decides_and_expires() {
        let cached = |secs_left: i64| {
            let mut c = creds_for(60);
            let leaf = mtls::leaf_of(&c.peer_chain.as_ref().unwrap()[0], None).unwrap();
            let now = time::OffsetDateTime::now_utc().unix_timestamp();
            c.peer_leaf = Some(Arc::new(Ok(mtls::Leaf {
                identity: "spiffe://cluster.local/ns/cached/sa/leaf".parse().unwrap(),
                not_after: now + secs_left,
                ..leaf
            })));
            c
        };
        let ok = authenticate(&cached(60), None).await.unwrap();
        assert_eq!(
            ok.identity.to_string(),
            "spiffe://cluster.local/ns/cached/sa/leaf"
        );
        let e = authenticate(&cached(-2), None).await.unwrap_err();
        assert_eq!(e.reason(), "mtls_cert_expired");
        let mut bad = creds_for(60);
        bad.peer_leaf = Some(Arc::new(Err(mtls::MtlsError::UriSanCount(2))));
        let e = authenticate(&bad, None).await.unwrap_err();
        assert_eq!(e.reason(), "mtls_uri_san_count");
    }
}
