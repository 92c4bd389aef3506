//! Flags and settings of the clusters meshca serves: the Kubernetes
//! integration and Istio's remote secrets.

use std::path::PathBuf;
use std::time::Duration;

use crate::authn::args::TokenVerification;
use crate::authn::token::ReviewLimits;
use crate::authz::ServiceAccountRef;
use crate::flags::{bounded, duration_between, err, ConfigError};
use crate::identity::TrustDomain;

/// Kubernetes settings, present when the integration is on.
#[derive(Debug, Clone)]
pub struct KubeSettings {
    pub kubeconfig: Option<PathBuf>,
    pub token_cache_ttl: Duration,
    pub tokenreview_timeout: Duration,
    /// TokenReview budget, in-flight cap and negative cache.
    pub review_limits: ReviewLimits,
    /// Token verification mode and issuer key refresh.
    pub token_verification: TokenVerification,
    /// `MESHCA_POD_INDEX_SYNC_WAIT`.
    pub pod_index_sync_wait: Duration,
}

/// Multi-cluster: Istio's remote secrets (`cluster` module).
#[derive(Debug, Clone, clap::Args)]
pub struct MultiClusterArgs {
    /// Watch Istio's remote secrets (label `istio/multiCluster: "true"`, one
    /// kubeconfig per data key named for the cluster id) and authenticate and
    /// authorize those clusters' callers as istiod does.
    ///
    /// The `clusterid` header picks the cluster's TokenReview and node authorizer (as istiod); with
    /// local verification the token's issuer picks it and a disagreeing header is refused
    /// (`token_cluster_mismatch`). Clusters are added, rotated and removed at runtime; a removed
    /// cluster's callers are refused at once (`token_unknown_cluster`,
    /// `impersonation_unknown_cluster`), an unsynced one's impersonations get Unavailable. Each
    /// remote cluster must let the kubeconfig's user create tokenreviews, list/watch pods and
    /// serviceaccounts and read issuer discovery. See docs/configuration.md, Multiple clusters.
    #[arg(long, env = "MESHCA_REMOTE_SECRETS", default_value_t = false, action = clap::ArgAction::Set)]
    pub remote_secrets: bool,
    /// Namespace of the remote secrets (meshca's own).
    ///
    /// The chart sets the release namespace; meshca needs `list` and `watch` on secrets there.
    #[arg(
        long,
        env = "MESHCA_REMOTE_SECRETS_NAMESPACE",
        default_value = "istio-system"
    )]
    pub remote_secrets_namespace: String,
    /// What a remote kubeconfig may use beyond inline credentials
    /// (comma-separated): `exec`, `clientKey`, `clientCertificate`,
    /// `tokenFile`, `certificateAuthority`, or an auth provider name. Each
    /// runs a command or reads a local file; none is allowed by default.
    ///
    /// `oidc` is always allowed. Anything else is refused with an error log line and
    /// `meshca_remote_kubeconfig_refused_total{reason}`; the other clusters keep working.
    #[arg(
        long,
        env = "PILOT_INSECURE_MULTICLUSTER_KUBECONFIG_OPTIONS",
        default_value = ""
    )]
    pub remote_kubeconfig_options: String,
    /// Most remote clusters registered at once (each runs a pod watch).
    ///
    /// More keys are ignored with a warning.
    #[arg(long, env = "MESHCA_REMOTE_CLUSTERS_MAX", default_value_t = 64)]
    pub remote_clusters_max: usize,
    /// A rotated remote cluster's old entry serves until the new one's pod
    /// index syncs, at most this long (1s..=10m).
    ///
    /// istiod's pending swap.
    #[arg(
        long,
        env = "MESHCA_REMOTE_CLUSTER_SYNC_TIMEOUT",
        default_value = "30s"
    )]
    pub remote_cluster_sync_timeout: String,
}

/// Parsed [`MultiClusterArgs`]: present when remote secrets are watched.
#[derive(Debug, Clone, Default)]
pub struct MultiClusterSettings {
    pub remote_secrets: Option<super::secrets::RemoteSecrets>,
}

impl MultiClusterArgs {
    pub fn parse(&self, kube_on: bool) -> Result<MultiClusterSettings, ConfigError> {
        if !self.remote_secrets {
            return Ok(MultiClusterSettings::default());
        }
        if !kube_on {
            return Err(err("MESHCA_REMOTE_SECRETS", "true", "needs Kubernetes"));
        }
        let ns = self.remote_secrets_namespace.trim();
        if ns.is_empty() {
            return Err(err(
                "MESHCA_REMOTE_SECRETS_NAMESPACE",
                ns,
                "must not be empty",
            ));
        }
        bounded(
            "MESHCA_REMOTE_CLUSTERS_MAX",
            self.remote_clusters_max,
            1,
            1000,
        )?;
        let sync_timeout = duration_between(
            "MESHCA_REMOTE_CLUSTER_SYNC_TIMEOUT",
            &self.remote_cluster_sync_timeout,
            Duration::from_secs(1),
            Duration::from_secs(600),
        )?;
        Ok(MultiClusterSettings {
            remote_secrets: Some(super::secrets::RemoteSecrets {
                namespace: ns.to_string(),
                policy: super::kubeconfig::KubeconfigPolicy::parse(&self.remote_kubeconfig_options),
                max_clusters: self.remote_clusters_max,
                sync_timeout,
            }),
        })
    }
}

/// What every cluster entry is built from: the server's authentication and
/// authorization settings, the same for the local cluster and remote ones.
#[derive(Debug, Clone)]
pub struct ClusterSettings {
    /// The Kubernetes settings (defaults when the integration is off).
    pub kube: Option<KubeSettings>,
    pub trusted_node_accounts: Vec<ServiceAccountRef>,
    /// The mesh trust domain.
    pub trust_domain: TrustDomain,
    /// The mesh trust domain first, then its aliases.
    pub trust_domains: Vec<TrustDomain>,
    pub token_audiences: Vec<String>,
    pub mtls_impersonation: bool,
    /// Pod watch disconnected longer than this: renewals and impersonation are refused.
    pub max_index_staleness: Duration,
    /// Remote clusters run a pod index for bounded mTLS renewal.
    pub renewal_pod_check: bool,
}
