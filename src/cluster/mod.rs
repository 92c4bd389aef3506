//! The cluster registry: per cluster id, what meshca needs to authenticate
//! and authorize that cluster's callers (a kube client's TokenReview path, a
//! pod index, a JWKS verifier, a node authorizer). The local cluster
//! (`CLUSTER_ID`) is one entry; remote clusters come from Istio's remote
//! secrets ([`secrets`]) and can be added, rotated and removed at runtime.
//!
//! Routing follows istiod: the `clusterid` header picks the cluster whose
//! TokenReview checks a token (empty means local) and, looked up exactly,
//! the node authorizer of an impersonation. With local verification meshca
//! does better than trusting the header: the cluster is the one whose keys
//! verify the token, and a header naming another cluster is refused.

pub mod args;
pub mod kubeconfig;
pub mod metrics;
pub mod secrets;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use tokio::task::JoinHandle;

use self::metrics::ClusterMetrics;
use crate::authn::jwks::IssuerKeys;
use crate::authn::local::TokenVerifier;
use crate::authn::metrics::{TokenPathMetrics, TokenReviewMetrics};
use crate::authn::token::{KubeTokenAuthenticator, TokenReviewSettings};
use crate::authn::{AuthnError, Caller, Credentials, TokenAuthenticator};
use crate::authz::{Evidence, ImpersonationError, KubeNodeAuthorizer, NodeAuthorizer, NodePolicy};
use crate::identity::SpiffeId;
use crate::podindex::PodIndex;
use args::ClusterSettings;

/// Reason codes of the registry's own refusals.
pub const REASON_UNKNOWN_CLUSTER: &str = "token_unknown_cluster";
pub const REASON_CLUSTER_MISMATCH: &str = "token_cluster_mismatch";

/// The clusters meshca serves, as far as binding an mTLS caller needs:
/// a leaf's serial is marked for the cluster it was issued for
/// ([`crate::ca::serial`]), and the caller is held to that cluster.
pub trait ClusterDirectory: Send + Sync + std::fmt::Debug {
    /// `CLUSTER_ID`.
    fn local_id(&self) -> &str;
    /// The registered cluster ids whose tag is `tag`.
    fn with_tag(&self, tag: crate::ca::serial::ClusterMatch) -> Vec<String>;
}

/// Only the local cluster (Kubernetes off).
#[derive(Debug, Clone)]
pub struct LocalCluster(pub String);

impl ClusterDirectory for LocalCluster {
    fn local_id(&self) -> &str {
        &self.0
    }

    fn with_tag(&self, tag: crate::ca::serial::ClusterMatch) -> Vec<String> {
        tag.matches(&self.0)
            .then(|| self.0.clone())
            .into_iter()
            .collect()
    }
}

/// The cluster an mTLS caller is bound to: the registered cluster its
/// certificate's serial is marked for; an unmarked serial (issued before
/// marks, or by istiod) is the local cluster's. A `clusterid` header naming
/// another cluster is refused, as is a mark no registered cluster has (or
/// two have). `None` for a caller without a client certificate.
///
/// `own` says whether the leaf was signed by one of this deployment's
/// signing certificates ([`crate::ca::own`]). A leaf of another CA under
/// the mesh roots (a sibling cluster's in multi-primary) is bound only when
/// its serial is marked for a registered *remote* cluster, and then held
/// to that cluster's pods; unmarked, or marked for the local cluster, it
/// proves nothing about this cluster and is refused (`mtls_foreign_issuer`).
pub fn mtls_cluster(
    dir: &dyn ClusterDirectory,
    creds: &Credentials,
    own: bool,
) -> Option<Result<String, AuthnError>> {
    use crate::ca::serial::mark_of_hex;
    let leaf = match creds.leaf()? {
        Ok(l) => l,
        Err(e) => return Some(Err(e.into())),
    };
    let mark = mark_of_hex(&leaf.serial_hex).cluster();
    let verified = match mark {
        None if own => dir.local_id().to_string(),
        None => {
            return Some(Err(AuthnError::MtlsForeignIssuer(
                "unmarked serial".to_string(),
            )))
        }
        Some(tag) => match dir.with_tag(tag).as_slice() {
            [one] if own || one != dir.local_id() => one.clone(),
            [_] => {
                return Some(Err(AuthnError::MtlsForeignIssuer(format!(
                    "serial marked for the local cluster (tag {tag})"
                ))))
            }
            _ => return Some(Err(AuthnError::MtlsClusterUnknown(tag.to_string()))),
        },
    };
    if let Some(h) = creds.cluster_id.as_deref().filter(|h| !h.is_empty()) {
        if h != verified {
            return Some(Err(AuthnError::MtlsClusterMismatch {
                header: h.to_string(),
                verified,
            }));
        }
    }
    Some(Ok(verified))
}

/// Where a cluster entry comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Local,
    /// `namespace/name` of the remote secret.
    Secret(String),
}

/// One cluster's authentication and authorization.
#[derive(Debug)]
pub struct Cluster {
    pub id: String,
    pub origin: Origin,
    /// Present when node authorization or local verification needs it.
    pub index: Option<Arc<PodIndex>>,
    /// ServiceAccounts, when local verification is on.
    pub accounts: Option<Arc<crate::podindex::accounts::AccountIndex>>,
    pub reviewer: Arc<KubeTokenAuthenticator>,
    /// The token path of the configured mode over this cluster's reviewer.
    pub tokens: Arc<TokenVerifier>,
    /// The issuer keys (fetched in every mode: local verification checks
    /// tokens against them, and `token-key` denylist entries need to know
    /// which key signed a token).
    pub keys: Option<Arc<IssuerKeys>>,
    /// Present when `CA_TRUSTED_NODE_ACCOUNTS` is set.
    pub authorizer: Option<KubeNodeAuthorizer>,
    /// Watches of a remote cluster, stopped when the entry goes.
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Cluster {
    /// Ready to authorize: its pod index (if any) has synced.
    pub fn is_synced(&self) -> bool {
        self.index.as_ref().is_none_or(|i| i.is_synced())
            && self.accounts.as_ref().is_none_or(|a| a.is_synced())
    }
}

/// Builds cluster entries from the server's configuration.
#[derive(Debug)]
pub struct ClusterFactory {
    pub settings: ClusterSettings,
    pub token_reviews: Arc<TokenReviewMetrics>,
    pub token_paths: Arc<TokenPathMetrics>,
}

impl ClusterFactory {
    /// The entry for `id` over `client`, and the tasks that keep it current
    /// (the caller owns them). `renewal_index`: also run the pod index for
    /// bounded mTLS renewal (the local cluster only).
    pub fn build(
        &self,
        id: &str,
        client: kube::Client,
        origin: Origin,
        renewal_index: bool,
    ) -> (Cluster, Vec<JoinHandle<()>>) {
        let cfg = &self.settings;
        let kube = cfg.kube.clone().unwrap_or_else(|| args::KubeSettings {
            kubeconfig: None,
            token_cache_ttl: std::time::Duration::from_secs(60),
            tokenreview_timeout: std::time::Duration::from_secs(5),
            review_limits: Default::default(),
            token_verification: Default::default(),
            pod_index_sync_wait: std::time::Duration::from_secs(3),
        });
        let verification = kube.token_verification;
        let mut tasks = Vec::new();
        // Each watch brings evidence of freshness well within the bound.
        let timing = crate::podindex::listwatch::Timing::for_max_staleness(cfg.max_index_staleness);
        let index = (!cfg.trusted_node_accounts.is_empty()
            || renewal_index
            || verification.mode.uses_local())
        .then(|| {
            let index = Arc::new(PodIndex::new());
            tasks.push(tokio::spawn(crate::podindex::watch::run(
                client.clone(),
                index.clone(),
                timing,
            )));
            index
        });
        // Local verification checks each token's ServiceAccount UID and
        // deletion, as the API server does, and so does a cached TokenReview
        // success: both run wherever the pod index runs (local verification
        // always runs it).
        let accounts = index.is_some().then(|| {
            let accounts = Arc::new(crate::podindex::accounts::AccountIndex::new());
            tasks.push(tokio::spawn(crate::podindex::accounts::run(
                client.clone(),
                accounts.clone(),
                timing,
            )));
            accounts
        });
        let authorizer = match (&index, cfg.trusted_node_accounts.is_empty()) {
            (Some(index), false) => Some(KubeNodeAuthorizer {
                policy: NodePolicy {
                    trusted: cfg.trusted_node_accounts.iter().cloned().collect(),
                    trust_domains: cfg.trust_domains.clone(),
                    cluster_id: id.to_string(),
                    mtls_impersonation: cfg.mtls_impersonation,
                },
                index: index.clone(),
                max_index_staleness: cfg.max_index_staleness,
                sync_wait: kube.pod_index_sync_wait,
            }),
            _ => None,
        };
        let settings = TokenReviewSettings {
            audiences: cfg.token_audiences.clone(),
            trust_domain: cfg.trust_domain.clone(),
            cluster_id: id.to_string(),
            cache_ttl: kube.token_cache_ttl,
            timeout: kube.tokenreview_timeout,
            limits: kube.review_limits,
            max_index_staleness: cfg.max_index_staleness,
        };
        let review = settings.clone();
        let mut reviewer = KubeTokenAuthenticator::new(client.clone(), settings, index.clone())
            .with_metrics(self.token_reviews.clone());
        if let Some(a) = &accounts {
            reviewer = reviewer.with_accounts(a.clone());
        }
        let reviewer = Arc::new(reviewer);
        let (tokens, keys) = crate::authn::local::build(
            &client,
            verification,
            &review,
            cfg.kube
                .as_ref()
                .map_or(std::time::Duration::ZERO, |k| k.pod_index_sync_wait),
            index.clone().zip(accounts.clone()),
            reviewer.clone(),
            self.token_paths.clone(),
        );
        tasks.push(tokio::spawn(keys.clone().run()));
        let cluster = Cluster {
            id: id.to_string(),
            origin,
            index,
            accounts,
            reviewer,
            tokens,
            keys: Some(keys),
            authorizer,
            tasks: Vec::new(),
        };
        (cluster, tasks)
    }

    /// A remote cluster's entry; its watches stop when the entry is dropped.
    /// With bounded renewal on it runs a pod index: a leaf issued for that
    /// cluster renews only while a pod of its identity lives there.
    pub fn build_remote(&self, id: &str, client: kube::Client, origin: Origin) -> Cluster {
        let renewal = self.settings.renewal_pod_check;
        let (mut c, tasks) = self.build(id, client, origin, renewal);
        c.tasks = tasks;
        c
    }
}

/// The clusters meshca serves, by id.
#[derive(Debug)]
pub struct ClusterRegistry {
    local: String,
    clusters: RwLock<HashMap<String, Arc<Cluster>>>,
    /// Whether remote secrets are watched, and whether their first list is done.
    remote_secrets: bool,
    secrets_listed: AtomicBool,
    mode: crate::authn::local::TokenVerificationMode,
    metrics: Option<Arc<ClusterMetrics>>,
}

impl ClusterRegistry {
    pub fn new(
        local: Cluster,
        mode: crate::authn::local::TokenVerificationMode,
        remote_secrets: bool,
        metrics: Option<Arc<ClusterMetrics>>,
    ) -> Self {
        let id = local.id.clone();
        let r = Self {
            local: id.clone(),
            clusters: RwLock::new(HashMap::from([(id, Arc::new(local))])),
            remote_secrets,
            secrets_listed: AtomicBool::new(false),
            mode,
            metrics,
        };
        r.publish_metrics();
        r
    }

    pub fn local_id(&self) -> &str {
        &self.local
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<Cluster>>> {
        self.clusters.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The entry registered under exactly `id`.
    pub fn get(&self, id: &str) -> Option<Arc<Cluster>> {
        self.read().get(id).cloned()
    }

    pub fn local(&self) -> Arc<Cluster> {
        // The local entry is inserted at construction and never removed.
        self.get(&self.local)
            .unwrap_or_else(|| unreachable!("the local cluster is always registered"))
    }

    /// Cluster ids, sorted.
    pub fn ids(&self) -> Vec<String> {
        let mut v: Vec<String> = self.read().keys().cloned().collect();
        v.sort();
        v
    }

    /// Registers (or replaces) a remote cluster; true when it replaced one.
    /// The local entry is never replaced.
    pub fn insert(&self, c: Cluster) -> bool {
        if c.id == self.local {
            return false;
        }
        let old = self
            .clusters
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(c.id.clone(), Arc::new(c));
        self.publish_metrics();
        old.is_some()
    }

    /// Drops a remote cluster: new requests naming it are refused at once;
    /// its watches stop when the last request using it finishes. True when
    /// it was registered.
    pub fn remove(&self, id: &str) -> bool {
        if id == self.local {
            return false;
        }
        let old = self
            .clusters
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        self.publish_metrics();
        old.is_some()
    }

    pub fn mark_secrets_listed(&self) {
        self.secrets_listed.store(true, Ordering::Relaxed);
    }

    /// Readiness: the remote secrets present at start have been read (each
    /// remote cluster's own sync is per request: Unavailable until then).
    pub fn readiness(&self) -> Result<(), &'static str> {
        if self.remote_secrets && !self.secrets_listed.load(Ordering::Relaxed) {
            return Err("remote secrets not listed yet");
        }
        Ok(())
    }

    pub(crate) fn kubeconfig_refused(&self, reason: &'static str) {
        if let Some(m) = &self.metrics {
            m.kubeconfig_refused(reason);
        }
    }

    /// Exports the known cluster ids (the bound on the metric label).
    pub fn publish_metrics(&self) {
        if let Some(m) = &self.metrics {
            let ids = self.ids();
            m.set_clusters(&self.local, &ids);
        }
    }

    /// Exports each cluster's sync state and index freshness (called at
    /// scrape time).
    pub fn publish_sync(&self) {
        if let Some(m) = &self.metrics {
            for c in self.read().values() {
                m.set_synced(&c.id, c.is_synced());
                let pods = c.index.as_ref().and_then(|i| i.freshness_age());
                let accounts = c.accounts.as_ref().and_then(|a| a.freshness_age());
                m.set_freshness(&c.id, "pod", pods);
                m.set_freshness(&c.id, "service_account", accounts);
            }
        }
    }

    /// The cluster a header selects for authentication (istiod: empty or the
    /// local id is local, else a registered remote).
    fn select(&self, header: Option<&str>) -> Result<Arc<Cluster>, AuthnError> {
        let id = header.filter(|h| !h.is_empty()).unwrap_or(&self.local);
        self.get(id).ok_or_else(|| {
            AuthnError::Token(
                format!(
                    "client claims to be in cluster {id:?}, but we only know about clusters {:?}",
                    self.ids()
                ),
                REASON_UNKNOWN_CLUSTER,
            )
        })
    }

    /// The cluster whose issuer keys can check `token`: its `iss` (and
    /// `kid`) name exactly one cluster. Read without verification: the
    /// chosen cluster's verifier then checks the signature.
    fn cluster_of_token(&self, token: &str) -> Option<Arc<Cluster>> {
        let (iss, kid) = peek_issuer_kid(token)?;
        let clusters = self.read();
        let by_issuer: Vec<&Arc<Cluster>> = clusters
            .values()
            .filter(|c| {
                c.keys
                    .as_ref()
                    .and_then(|k| k.current())
                    .is_some_and(|s| s.issuer == iss)
            })
            .collect();
        if let [one] = by_issuer.as_slice() {
            return Some((*one).clone());
        }
        // Clusters sharing an issuer (a common default) differ by key.
        let by_key: Vec<&&Arc<Cluster>> = by_issuer
            .iter()
            .filter(|c| {
                c.keys
                    .as_ref()
                    .and_then(|k| k.current())
                    .is_some_and(|s| kid.as_deref().is_some_and(|kid| s.keys.get(kid).is_some()))
            })
            .collect();
        match by_key.as_slice() {
            [one] => Some((**one).clone()),
            _ => None,
        }
    }
}

/// Bounded mTLS renewal: the pod index of the cluster a certificate was
/// issued for (the local one included).
impl crate::renewal::LivePods for ClusterRegistry {
    fn view_in(
        &self,
        cluster: &str,
        namespace: &str,
        service_account: &str,
    ) -> Option<crate::renewal::IndexView> {
        let c = self.get(cluster)?;
        let index = c.index.as_deref()?;
        Some(crate::renewal::IndexView::of(
            Some(index),
            namespace,
            service_account,
        ))
    }
}

/// `iss` and `kid` of a JWT, unverified.
fn peek_issuer_kid(token: &str) -> Option<(String, Option<String>)> {
    #[derive(serde::Deserialize)]
    struct Iss {
        iss: Option<String>,
    }
    let header = jsonwebtoken::decode_header(token).ok()?;
    let claims: Iss = jsonwebtoken::dangerous::insecure_decode_claims(token).ok()?;
    Some((claims.iss?, header.kid))
}

/// istiod's KubeJWT routing over the registry, plus the token's own cluster
/// under local verification.
#[tonic::async_trait]
impl TokenAuthenticator for ClusterRegistry {
    async fn authenticate(
        &self,
        token: &str,
        cluster_id: Option<&str>,
    ) -> Result<Caller, AuthnError> {
        let header = cluster_id.filter(|h| !h.is_empty());
        let derived = if self.mode.uses_local() {
            self.cluster_of_token(token)
        } else {
            None
        };
        let (cluster, from_token) = match derived {
            Some(c) => (c, true),
            None => (self.select(header)?, false),
        };
        let mut caller = cluster
            .tokens
            .authenticate(token, Some(&cluster.id))
            .await?;
        if from_token {
            if let Some(h) = header.filter(|h| *h != cluster.id) {
                return Err(AuthnError::Token(
                    format!(
                        "clusterid header names cluster {h:?}, the token was verified by cluster {:?}",
                        cluster.id
                    ),
                    REASON_CLUSTER_MISMATCH,
                ));
            }
        }
        if let Some(k) = &mut caller.kube {
            k.cluster_id = Some(cluster.id.clone());
        }
        Ok(caller)
    }

    /// A success cached by any cluster counts; otherwise the local answer.
    /// The local cluster is asked first (most callers are local).
    fn cached_verdict(&self, token: &str) -> Option<bool> {
        let local = self.local().tokens.cached_verdict(token);
        if local == Some(true) {
            return local;
        }
        let remotes: Vec<Arc<Cluster>> = self
            .read()
            .values()
            .filter(|c| c.id != self.local)
            .cloned()
            .collect();
        if remotes
            .iter()
            .any(|c| c.tokens.cached_verdict(token) == Some(true))
        {
            return Some(true);
        }
        local
    }
}

/// Which key signed a token, over every cluster's issuer keys: a
/// denylisted key is looked for in all of them (one key may be trusted by
/// several clusters), the signer of a token caller in its own cluster's.
#[tonic::async_trait]
impl crate::authn::TokenSigners for ClusterRegistry {
    fn signed_by_one_of(
        &self,
        token: &str,
        kids: &std::collections::HashSet<String>,
    ) -> Option<String> {
        let clusters: Vec<Arc<Cluster>> = self.read().values().cloned().collect();
        clusters
            .iter()
            .filter_map(|c| c.keys.as_ref())
            .find_map(|k| k.signed_by_one_of(token, kids))
    }

    async fn signer(&self, token: &str, cluster: Option<&str>) -> Result<String, String> {
        let id = cluster.filter(|c| !c.is_empty()).unwrap_or(&self.local);
        let c = self
            .get(id)
            .ok_or_else(|| format!("cluster {id:?} is not registered"))?;
        let keys = c
            .keys
            .as_ref()
            .ok_or_else(|| format!("cluster {id:?} has no issuer keys"))?;
        keys.signer_of(token)
            .await
            .map_err(|why| format!("cluster {id:?}: {why}"))
    }
}

/// istiod's MulticlusterNodeAuthorizor: the `clusterid` header, looked up
/// exactly (no "empty means local"), picks the cluster's authorizer. An
/// mTLS caller is held to its certificate's cluster ([`mtls_cluster`]).
impl NodeAuthorizer for ClusterRegistry {
    fn authorize(
        &self,
        caller: &Caller,
        requested: &str,
        creds: &Credentials,
    ) -> Result<(SpiffeId, Evidence), ImpersonationError> {
        let id = self.authorizing_cluster(caller, creds)?;
        let cluster = self
            .get(&id)
            .ok_or_else(|| ImpersonationError::UnknownCluster(id.to_string()))?;
        let authz = cluster
            .authorizer
            .as_ref()
            .ok_or(ImpersonationError::NotConfigured)?;
        authz.authorize(caller, requested, creds)
    }

    fn unsynced_index(&self, creds: &Credentials) -> Option<(Arc<PodIndex>, std::time::Duration)> {
        let id = match creds.leaf() {
            // The issuer refused a foreign leaf's binding before this.
            Some(_) => mtls_cluster(self, creds, true)?.ok()?,
            None => creds.cluster_id.clone().unwrap_or_default(),
        };
        self.get(&id)?.authorizer.as_ref()?.unsynced_index(creds)
    }
}

impl ClusterRegistry {
    /// The cluster whose node authorizer decides: the header's (istiod),
    /// or for an mTLS caller the one its certificate was issued for.
    fn authorizing_cluster(
        &self,
        caller: &Caller,
        creds: &Credentials,
    ) -> Result<String, ImpersonationError> {
        if caller.method == crate::authn::AuthnMethod::Mtls {
            // The issuer refused a foreign leaf's binding before this.
            if let Some(bound) = mtls_cluster(self, creds, true) {
                return bound
                    .map_err(|e| ImpersonationError::MtlsCluster(e.reason(), e.to_string()));
            }
        }
        Ok(creds.cluster_id.clone().unwrap_or_default())
    }
}

impl ClusterDirectory for ClusterRegistry {
    fn local_id(&self) -> &str {
        &self.local
    }

    fn with_tag(&self, tag: crate::ca::serial::ClusterMatch) -> Vec<String> {
        self.read()
            .keys()
            .filter(|id| tag.matches(id))
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authn::local::TokenVerificationMode;
    use crate::authn::token::ReviewBackend;
    use crate::podindex::{pod, IndexEvent, Phase};
    use k8s_openapi::api::authentication::v1::{TokenReviewStatus, UserInfo};
    use test_case::test_case;

    /// One cluster's API server: authenticates only its own token.
    #[derive(Debug)]
    struct Apiserver(&'static str);

    #[tonic::async_trait]
    impl ReviewBackend for Apiserver {
        async fn review(&self, token: &str, _: &[String]) -> Result<TokenReviewStatus, String> {
            let ok = token == jwt(self.0);
            Ok(TokenReviewStatus {
                authenticated: Some(ok),
                user: ok.then(|| UserInfo {
                    username: Some("system:serviceaccount:istio-system:ztunnel".into()),
                    groups: Some(vec!["system:serviceaccounts".into()]),
                    extra: Some(
                        [
                            (
                                "authentication.kubernetes.io/pod-name".to_string(),
                                vec!["zt".to_string()],
                            ),
                            (
                                "authentication.kubernetes.io/pod-uid".to_string(),
                                vec!["zt-uid".to_string()],
                            ),
                        ]
                        .into(),
                    ),
                    uid: None,
                }),
                ..Default::default()
            })
        }
    }

    /// A JWT-shaped token that passes the pre-check, distinct per cluster.
    fn jwt(cluster: &str) -> String {
        use base64::Engine;
        let b = |v: serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
        };
        format!(
            "{}.{}.c2ln",
            b(serde_json::json!({"alg": "RS256", "kid": format!("k-{cluster}")})),
            b(
                serde_json::json!({"iss": format!("https://{cluster}"), "sub": cluster, "exp": 4_000_000_000i64})
            )
        )
    }

    /// A fixed issuer and one RSA key id (the key bytes are never used:
    /// these tokens are checked by the fake API server).
    #[derive(Debug)]
    struct Discovery(String, String);

    #[tonic::async_trait]
    impl crate::authn::jwks::KeySource for Discovery {
        async fn fetch(&self) -> Result<(String, Vec<u8>), crate::authn::jwks::JwksError> {
            let jwks = serde_json::json!({"keys": [{"kty": "RSA", "kid": self.1, "n": "AQAB", "e": "AQAB"}]});
            Ok((self.0.clone(), jwks.to_string().into_bytes()))
        }
    }

    async fn with_keys(mut c: Cluster, issuer: &str, kid: &str) -> Cluster {
        let keys = Arc::new(IssuerKeys::new(
            Arc::new(Discovery(issuer.into(), kid.into())),
            Default::default(),
        ));
        assert!(keys.refresh().await && keys.current().is_some());
        c.keys = Some(keys);
        c
    }

    async fn local_mode_registry() -> ClusterRegistry {
        let r = ClusterRegistry::new(
            with_keys(
                cluster("Kubernetes", true),
                "https://Kubernetes",
                "k-Kubernetes",
            )
            .await,
            TokenVerificationMode::Local,
            false,
            None,
        );
        r.insert(with_keys(cluster("east", true), "https://east", "k-east").await);
        // Two clusters with one issuer (a common default) differ by key.
        r.insert(with_keys(cluster("c1", false), "https://shared", "k-c1").await);
        r.insert(with_keys(cluster("c2", false), "https://shared", "k-c2").await);
        r
    }

    fn token(iss: &str, kid: &str) -> String {
        use base64::Engine;
        let b = |v: serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
        };
        format!(
            "{}.{}.c2ln",
            b(serde_json::json!({"alg": "RS256", "kid": kid})),
            b(serde_json::json!({"iss": iss}))
        )
    }

    #[test_case("https://east", "k-other", Some("east") ; "unique issuer")]
    #[test_case("https://shared", "k-c2", Some("c2") ; "shared issuer by key")]
    #[test_case("https://shared", "k-c9", None ; "shared issuer unknown key")]
    #[test_case("https://elsewhere", "k-east", None ; "unknown issuer")]
    #[tokio::test]
    async fn cluster_of_token_table(iss: &str, kid: &str, want: Option<&str>) {
        let r = local_mode_registry().await;
        let got = r.cluster_of_token(&token(iss, kid)).map(|c| c.id.clone());
        assert_eq!(got.as_deref(), want);
        assert!(r.cluster_of_token("not-a-jwt").is_none());
    }

    // With local verification the token's cluster wins, and a header
    // naming another one is refused (istiod would trust the header).
    #[test_case(Some("east"), Ok("east") ; "agreeing header")]
    #[test_case(None, Ok("east") ; "no header")]
    #[test_case(Some("Kubernetes"), Err("token_cluster_mismatch") ; "local header")]
    #[test_case(Some("west"), Err("token_cluster_mismatch") ; "unknown header")]
    #[tokio::test]
    async fn header_must_agree_with_the_token(header: Option<&str>, want: Result<&str, &str>) {
        let r = local_mode_registry().await;
        let got = r.authenticate(&jwt("east"), header).await;
        match (got, want) {
            (Ok(c), Ok(id)) => assert_eq!(c.kube.unwrap().cluster_id.as_deref(), Some(id)),
            (Err(e), Err(reason)) => assert_eq!(e.reason(), reason, "{e}"),
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    /// Which key signed a token is asked of the token caller's own
    /// cluster; a denylisted key is looked for in every cluster's keys (one
    /// key may be trusted by several clusters).
    #[tokio::test]
    async fn token_signers_are_per_cluster() {
        use crate::authn::jwks::test_keys::{doc, ec_key, sign, Switch};
        use crate::authn::TokenSigners;
        let (local_key, east_key) = (ec_key("k-local"), ec_key("k-east"));
        let mut clusters = Vec::new();
        for (id, key) in [("Kubernetes", &local_key), ("east", &east_key)] {
            let keys = Arc::new(IssuerKeys::new(
                Switch::new(&format!("https://{id}"), doc(&[key])),
                crate::authn::jwks::RefreshPolicy {
                    min_interval: std::time::Duration::ZERO,
                    ..Default::default()
                },
            ));
            assert!(keys.refresh().await);
            let mut c = cluster(id, false);
            c.keys = Some(keys);
            clusters.push(c);
        }
        let east = clusters.pop().unwrap();
        let r = ClusterRegistry::new(
            clusters.pop().unwrap(),
            TokenVerificationMode::Review,
            false,
            None,
        );
        r.insert(east);
        let claims = serde_json::json!({"sub": "x"});
        let by_east = sign(&east_key, None, &claims);
        let by_local = sign(&local_key, Some("k-east"), &claims);
        assert_eq!(
            r.signer(&by_east, Some("east")).await.as_deref(),
            Ok("k-east")
        );
        assert_eq!(r.signer(&by_local, None).await.as_deref(), Ok("k-local"));
        assert_eq!(
            r.signer(&by_local, Some("")).await.as_deref(),
            Ok("k-local")
        );
        // Another cluster's key establishes nothing for this one.
        assert!(r.signer(&by_east, None).await.is_err());
        assert!(r.signer(&by_local, Some("east")).await.is_err());
        let e = r.signer(&by_east, Some("west")).await.unwrap_err();
        assert!(e.contains("not registered"), "{e}");
        let deny: std::collections::HashSet<String> = ["k-east".to_string()].into();
        assert_eq!(
            r.signed_by_one_of(&by_east, &deny).as_deref(),
            Some("k-east")
        );
        assert_eq!(r.signed_by_one_of(&by_local, &deny), None);
    }

    fn cluster(id: &'static str, authorize: bool) -> Cluster {
        let index = Arc::new(PodIndex::new());
        index.apply(IndexEvent::Init);
        for p in [
            pod(
                "istio-system",
                "zt",
                "zt-uid",
                Some("n1"),
                "ztunnel",
                Phase::Running,
            ),
            pod("app", "app-0", "a", Some("n1"), "app", Phase::Running),
        ] {
            index.apply(IndexEvent::InitApply(p));
        }
        index.apply(IndexEvent::InitDone);
        let settings = TokenReviewSettings {
            audiences: vec!["istio-ca".into()],
            trust_domain: crate::identity::TrustDomain::new("cluster.local").unwrap(),
            cluster_id: id.into(),
            cache_ttl: std::time::Duration::from_secs(60),
            timeout: std::time::Duration::from_secs(5),
            limits: Default::default(),
            max_index_staleness: std::time::Duration::from_secs(60),
        };
        let reviewer = Arc::new(KubeTokenAuthenticator::with_backend(
            Arc::new(Apiserver(id)),
            settings,
            None,
        ));
        Cluster {
            id: id.into(),
            origin: Origin::Local,
            index: Some(index.clone()),
            accounts: None,
            tokens: Arc::new(TokenVerifier {
                mode: TokenVerificationMode::Review,
                local: None,
                review: Some(reviewer.clone()),
                require_pod_binding: false,
                metrics: None,
            }),
            reviewer,
            keys: None,
            authorizer:
                authorize.then(|| KubeNodeAuthorizer {
                    policy: NodePolicy {
                        trusted: crate::config::parse_service_accounts("istio-system/ztunnel")
                            .unwrap()
                            .into_iter()
                            .collect(),
                        trust_domains: vec![
                            crate::identity::TrustDomain::new("cluster.local").unwrap()
                        ],
                        cluster_id: id.into(),
                        mtls_impersonation: false,
                    },
                    index,
                    max_index_staleness: std::time::Duration::from_secs(60),
                    sync_wait: std::time::Duration::ZERO,
                }),
            tasks: Vec::new(),
        }
    }

    fn registry() -> ClusterRegistry {
        let r = ClusterRegistry::new(
            cluster("Kubernetes", true),
            TokenVerificationMode::Review,
            true,
            None,
        );
        assert!(!r.insert(cluster("east", true)));
        assert!(!r.insert(cluster("bare", false)));
        r
    }

    // istiod's KubeJWT routing: (token of cluster, clusterid header) -> the
    // cluster that verified it, or the refusal.
    #[test_case("Kubernetes", None, Ok("Kubernetes") ; "no header is local")]
    #[test_case("Kubernetes", Some(""), Ok("Kubernetes") ; "empty header is local")]
    #[test_case("Kubernetes", Some("Kubernetes"), Ok("Kubernetes") ; "local by id")]
    #[test_case("east", Some("east"), Ok("east") ; "remote by id")]
    #[test_case("east", None, Err("token_not_authenticated") ; "remote token reviewed locally")]
    #[test_case("east", Some("Kubernetes"), Err("token_not_authenticated") ; "remote token wrong header")]
    #[test_case("east", Some("west"), Err("token_unknown_cluster") ; "unknown cluster")]
    #[tokio::test]
    async fn token_routing(token_of: &str, header: Option<&str>, want: Result<&str, &str>) {
        let r = registry();
        let got = r.authenticate(&jwt(token_of), header).await;
        match (got, want) {
            (Ok(c), Ok(id)) => assert_eq!(c.kube.unwrap().cluster_id.as_deref(), Some(id)),
            (Err(e), Err(reason)) => assert_eq!(e.reason(), reason, "{e}"),
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    // MulticlusterNodeAuthorizor: the header, exactly, picks the authorizer.
    #[test_case(None, Err("impersonation_unknown_cluster") ; "no header")]
    #[test_case(Some("Kubernetes"), Ok(()) ; "local")]
    #[test_case(Some("east"), Ok(()) ; "remote")]
    #[test_case(Some("west"), Err("impersonation_unknown_cluster") ; "unknown")]
    #[test_case(Some("bare"), Err("impersonation_not_configured") ; "no authorizer")]
    #[tokio::test]
    async fn impersonation_routing(header: Option<&str>, want: Result<(), &str>) {
        let r = registry();
        let caller = r.authenticate(&jwt("Kubernetes"), None).await.unwrap();
        let creds = Credentials {
            cluster_id: header.map(str::to_string),
            ..Default::default()
        };
        let got = r
            .authorize(&caller, "spiffe://cluster.local/ns/app/sa/app", &creds)
            .map(|_| ());
        assert_eq!(got.map_err(|e| e.reason()), want);
    }

    /// A leaf of a fresh test CA for spiffe://cluster.local/ns/a/sa/b with
    /// `mark` in its serial, and its chain as a client presents it.
    fn marked_leaf(
        mark: Option<crate::ca::serial::LeafMark>,
    ) -> (SpiffeId, Vec<rustls_pki_types::CertificateDer<'static>>) {
        use rustls_pki_types::pem::PemObject;
        let pki = crate::testing::TestPki::new(crate::ca::generate::KeyType::EcdsaP256);
        let bundle =
            crate::ca::CaBundle::load_dir(pki.path(), time::OffsetDateTime::now_utc()).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let id: SpiffeId = "spiffe://cluster.local/ns/a/sa/b".parse().unwrap();
        let leaf = bundle
            .sign_leaf_for(
                &rcgen::PublicKeyData::subject_public_key_info(&key),
                &id,
                false,
                &crate::testing::validity_hours(-1, 1),
                mark,
            )
            .unwrap();
        let chain = rustls_pki_types::CertificateDer::pem_slice_iter(leaf.pem.as_bytes())
            .collect::<Result<_, _>>()
            .unwrap();
        (id, chain)
    }

    /// A leaf of another CA under the mesh roots (`own` false) is bound only
    /// by a mark naming a registered remote cluster; lineage marks (version
    /// 2, the local cluster's leaves too) bind as version 1 marks do.
    #[test_case(None, false, true, Ok("Kubernetes") ; "own unmarked")]
    #[test_case(None, false, false, Err("mtls_foreign_issuer") ; "foreign unmarked")]
    #[test_case(Some("Kubernetes"), false, false, Err("mtls_foreign_issuer") ; "foreign marked local")]
    #[test_case(Some("east"), false, false, Ok("east") ; "foreign marked remote")]
    #[test_case(Some("west"), false, false, Err("mtls_cluster_unknown") ; "foreign marked unregistered")]
    #[test_case(Some("Kubernetes"), true, true, Ok("Kubernetes") ; "own lineage local")]
    #[test_case(Some("east"), true, true, Ok("east") ; "own lineage remote")]
    #[test_case(Some("west"), true, true, Err("mtls_cluster_unknown") ; "own lineage unregistered")]
    #[test_case(Some("Kubernetes"), true, false, Err("mtls_foreign_issuer") ; "foreign lineage local")]
    #[test_case(Some("east"), true, false, Ok("east") ; "foreign lineage remote")]
    fn a_serial_binds_to_this_cluster_only_when_this_deployment_signed_it(
        mark: Option<&str>,
        lineage: bool,
        own: bool,
        want: Result<&str, &str>,
    ) {
        use crate::ca::serial::{ClusterTag, LeafMark, Lineage, LineageTag, NodeTag};
        let r = registry();
        let mark = mark.map(|c| match lineage {
            false => LeafMark::Cluster(ClusterTag::of(c)),
            true => LeafMark::Lineage(Lineage {
                cluster: ClusterTag::of(c).short(),
                lineage: LineageTag([1, 2, 3, 4]),
                node: NodeTag::of("n1"),
            }),
        });
        let (_, chain) = marked_leaf(mark);
        let creds = Credentials {
            peer_chain: Some(chain.into()),
            ..Default::default()
        };
        let got = mtls_cluster(&r, &creds, own).unwrap();
        assert_eq!(got.as_deref().map_err(|e| e.reason()), want);
    }

    /// An mTLS caller's cluster is its certificate's (a serial marked for
    /// a registered cluster; unmarked is local), whatever the header says.
    #[test_case(None, None, Ok("Kubernetes") ; "unmarked no header")]
    #[test_case(None, Some("Kubernetes"), Ok("Kubernetes") ; "unmarked local header")]
    #[test_case(None, Some(""), Ok("Kubernetes") ; "unmarked empty header")]
    #[test_case(None, Some("east"), Err("mtls_cluster_mismatch") ; "unmarked remote header")]
    #[test_case(Some("east"), None, Ok("east") ; "marked no header")]
    #[test_case(Some("east"), Some("east"), Ok("east") ; "marked agreeing header")]
    #[test_case(Some("east"), Some("Kubernetes"), Err("mtls_cluster_mismatch") ; "marked local header")]
    #[test_case(Some("west"), None, Err("mtls_cluster_unknown") ; "marked unregistered")]
    #[test_case(Some("west"), Some("west"), Err("mtls_cluster_unknown") ; "marked unregistered named")]
    fn mtls_callers_are_bound_to_their_certificates_cluster(
        mark: Option<&str>,
        header: Option<&str>,
        want: Result<&str, &str>,
    ) {
        let r = registry();
        let (id, chain) =
            marked_leaf(mark.map(|c| {
                crate::ca::serial::LeafMark::Cluster(crate::ca::serial::ClusterTag::of(c))
            }));
        let creds = Credentials {
            peer_chain: Some(chain.into()),
            cluster_id: header.map(str::to_string),
            ..Default::default()
        };
        let got = mtls_cluster(&r, &creds, true).unwrap();
        assert_eq!(got.as_deref().map_err(|e| e.reason()), want);
        // Without a client certificate there is nothing to bind.
        assert!(mtls_cluster(&r, &Credentials::default(), true).is_none());
        // The node authorizer picks the same cluster, or refuses the same way.
        let caller = Caller {
            method: crate::authn::AuthnMethod::Mtls,
            identity: id,
            kube: None,
        };
        match (r.authorizing_cluster(&caller, &creds), want) {
            (Ok(c), Ok(w)) => assert_eq!(c, w),
            (Err(e), Err(w)) => assert_eq!(e.reason(), w),
            (got, want) => panic!("{got:?} vs {want:?}"),
        }
    }

    #[tokio::test]
    async fn a_removed_cluster_is_refused_at_once() {
        let r = registry();
        assert!(r.authenticate(&jwt("east"), Some("east")).await.is_ok());
        assert!(r.remove("east"));
        let e = r
            .authenticate(&jwt("east"), Some("east"))
            .await
            .unwrap_err();
        assert_eq!(e.reason(), "token_unknown_cluster");
        // The local cluster is never removed or replaced from outside.
        assert!(!r.remove("Kubernetes"));
        assert!(!r.insert(cluster("Kubernetes", false)));
        assert!(r.local().authorizer.is_some());
        assert_eq!(r.ids(), vec!["Kubernetes".to_string(), "bare".into()]);
    }

    #[tokio::test]
    async fn a_success_cached_by_a_remote_cluster_is_familiar() {
        let r = registry();
        assert_eq!(r.cached_verdict(&jwt("east")), None);
        r.authenticate(&jwt("east"), Some("east")).await.unwrap();
        assert_eq!(r.cached_verdict(&jwt("east")), Some(true));
        assert_eq!(r.cached_verdict("not-a-jwt"), Some(false));
        r.remove("east");
        assert_eq!(
            r.cached_verdict(&jwt("east")),
            None,
            "its cache went with it"
        );
    }

    #[test]
    fn renewal_reads_the_index_of_the_certificates_cluster() {
        use crate::renewal::{IndexView, LivePods};
        let r = ClusterRegistry::new(
            cluster("Kubernetes", true),
            TokenVerificationMode::Review,
            false,
            None,
        );
        let live = |v: Option<IndexView>| match v {
            Some(IndexView::Synced { live_pod, .. }) => Some(live_pod),
            Some(other) => panic!("{other:?}"),
            None => None,
        };
        assert_eq!(live(r.view_in("Kubernetes", "app", "app")), Some(true));
        assert_eq!(
            live(r.view_in("east", "app", "app")),
            None,
            "not registered"
        );
        r.insert(cluster("east", true));
        assert_eq!(live(r.view_in("east", "app", "app")), Some(true));
        assert_eq!(live(r.view_in("east", "app", "other")), Some(false));
        // A disconnected index says so; the policy decides what that means.
        r.get("east")
            .unwrap()
            .index
            .as_ref()
            .unwrap()
            .mark_disconnected();
        assert!(matches!(
            r.view_in("east", "app", "app"),
            Some(IndexView::Synced {
                disconnected_for: Some(_),
                ..
            })
        ));
        r.remove("east");
        assert_eq!(live(r.view_in("east", "app", "app")), None);
    }

    #[test]
    fn readiness_waits_for_the_remote_secrets() {
        let r = registry();
        assert_eq!(r.readiness(), Err("remote secrets not listed yet"));
        r.mark_secrets_listed();
        assert_eq!(r.readiness(), Ok(()));
    }
}
