//! Configuration: CLI flags with Istio's environment variable names beside
//! them, parsed once at startup into types that cannot hold invalid values.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::ca::ttl::JitterBand;
use crate::ca::{CsrPolicy, TtlPolicy};
use crate::flags::{bounded_duration, err, list, MAX_PERIOD};
use crate::identity::TrustDomain;
use crate::transport::{AdminLimits, InputLimits, TransportLimits};

pub use crate::audit::settings::{AnchorTarget, AuditSettings, AuditSinkKind, HandshakeAudit};
pub use crate::authn::args::TokenVerification;
pub use crate::authz::{parse_service_accounts, ServiceAccountRef};
pub use crate::cluster::args::{KubeSettings, MultiClusterSettings};
pub use crate::flags::{ConfigError, MAX_TTL_LIMIT};
pub use crate::guards::KillSwitchSettings;

/// Flags of `meshca serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Embedded default: a local CA in --data-dir (created on first start,
    /// reused after), serving on 127.0.0.1, no cluster needed.
    #[arg(long)]
    pub dev: bool,
    /// Data directory for --dev.
    ///
    /// Holds the CA and the dev client identity. Default: `$XDG_DATA_HOME/meshca`, else
    /// `~/.local/share/meshca`.
    #[arg(long, env = "MESHCA_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// gRPC listen address [default: 0.0.0.0:15012, or 127.0.0.1:15012 with --dev].
    #[arg(long, env = "MESHCA_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Directory holding `cacerts` (ca-cert.pem, ca-key.pem, cert-chain.pem,
    /// root-cert.pem) or a kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt).
    ///
    /// A partial bundle is a startup error naming the missing files.
    #[arg(long, env = "ROOT_CA_DIR", default_value = "./etc/cacerts")]
    #[arg(help_heading = "Certificates")]
    pub ca_dir: PathBuf,
    /// Mesh trust domain.
    #[arg(long, env = "TRUST_DOMAIN", default_value = "cluster.local")]
    #[arg(help_heading = "Certificates")]
    pub trust_domain: String,
    /// Other trust domains accepted for client certificates and impersonation (comma-separated).
    ///
    /// An identity under an alias is the mesh identity everywhere identities are matched:
    /// `identity` denylist entries, `meshca revoke --identity` and `meshca audit query --identity`
    /// (both read the variable too).
    #[arg(long, env = "TRUST_DOMAIN_ALIASES", default_value = "")]
    #[arg(help_heading = "Certificates")]
    pub trust_domain_aliases: String,
    /// Lifetime when the request asks for <= 0 seconds.
    #[arg(long, env = "DEFAULT_WORKLOAD_CERT_TTL", default_value = "24h")]
    #[arg(help_heading = "Certificates")]
    pub default_ttl: String,
    /// Longest lifetime a request may ask for; longer requests are refused.
    ///
    /// Refused with `InvalidArgument`, as istiod does.
    #[arg(long, env = "MAX_WORKLOAD_CERT_TTL", default_value = "2160h")]
    #[arg(help_heading = "Certificates")]
    pub max_ttl: String,
    /// Draw each leaf's lifetime from --lifetime-jitter-band of the granted
    /// TTL, so leaves issued together do not renew together. `false` writes
    /// exactly the granted TTL (istiod's validity for TTLs of 8 minutes or more).
    ///
    /// ztunnel renews at exactly the midpoint written in the certificate, so without jitter a burst
    /// of issuance renews in one burst. With `false`, NotAfter - NotBefore = TTL + 2 min, istiod's
    /// validity, for every TTL of 8 minutes or more.
    #[arg(long, env = "MESHCA_LIFETIME_JITTER", default_value_t = true, action = clap::ArgAction::Set)]
    #[arg(help_heading = "Certificates")]
    pub lifetime_jitter: bool,
    /// Band of the granted TTL a leaf's lifetime is drawn from, `MIN-MAX` percent (50 <= MIN <= MAX <= 100).
    ///
    /// Uniform in whole seconds; written into each audit record (`lifetime`).
    #[arg(long, env = "MESHCA_LIFETIME_JITTER_BAND", default_value = "90-100")]
    #[arg(help_heading = "Certificates")]
    pub lifetime_jitter_band: String,
    /// CSR content checks: `strict` (CSR SANs must be the caller's identity) or `istiod` (ignored).
    ///
    /// `istiod` ignores the CSR's SANs and extensions, as istiod does.
    #[arg(long, env = "MESHCA_CSR_POLICY", value_enum, default_value_t = CsrPolicy::Strict)]
    #[arg(help_heading = "Certificates")]
    pub csr_policy: CsrPolicy,
    /// DNS names / IPs of the serving certificate (comma-separated).
    ///
    /// The names in the serving certificate meshca issues itself. `serve --dev` always adds
    /// `istiod.istio-system.svc`: Istio's CA client (istio-agent) verifies that name, not
    /// `localhost`, when its `CA_ADDR` contains `localhost`. Which names each client address needs:
    /// docs/istio.md.
    #[arg(
        long,
        env = "MESHCA_SERVING_NAMES",
        default_value = "meshca.istio-system.svc,meshca.istio-system.svc.cluster.local,localhost,127.0.0.1"
    )]
    pub serving_names: String,
    /// `ns/sa,...` of node proxies allowed to impersonate (empty disables impersonation).
    ///
    /// For example `istio-system/ztunnel`. A malformed entry stops startup.
    #[arg(long, env = "CA_TRUSTED_NODE_ACCOUNTS", default_value = "")]
    #[arg(help_heading = "Callers and Kubernetes")]
    pub trusted_node_accounts: String,
    /// TokenReview audiences (comma-separated).
    #[arg(long, env = "TOKEN_AUDIENCES", default_value = "istio-ca")]
    #[arg(help_heading = "Callers and Kubernetes")]
    pub token_audiences: String,
    /// This cluster's id, matched against the `clusterid` header.
    ///
    /// Must equal the caller's `clusterid` header for impersonation.
    #[arg(long, env = "CLUSTER_ID", default_value = "Kubernetes")]
    #[arg(help_heading = "Callers and Kubernetes")]
    pub cluster_id: String,
    /// Accept a reloaded root bundle that adds or removes roots.
    ///
    /// Otherwise a root change is rejected and the old bundle keeps serving.
    #[arg(long, env = "ISTIO_MULTIROOT_MESH", default_value_t = false, action = clap::ArgAction::Set)]
    #[arg(help_heading = "Certificates")]
    pub multiroot: bool,
    /// How often CA files are re-read even without a file event.
    #[arg(long, env = "MESHCA_RELOAD_POLL", default_value = "10s")]
    #[arg(help_heading = "Certificates")]
    pub reload_poll: String,
    /// Health and metrics HTTP address [default: 0.0.0.0:15014, or 127.0.0.1:15014 with --dev].
    ///
    /// Plain HTTP `/healthz`, `/readyz`, `/metrics`, unauthenticated: it listens on all interfaces
    /// so kubelet probes and Prometheus reach it; restrict other callers with a NetworkPolicy.
    #[arg(long, env = "MESHCA_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// Kubernetes integration (TokenReview callers, pod index): `auto` turns it
    /// on in a cluster or when a kubeconfig is given; with --dev only for
    /// --kubeconfig on the command line (an exported KUBECONFIG is ignored).
    #[arg(long, env = "MESHCA_KUBERNETES", value_enum, default_value_t = KubeMode::Auto)]
    #[arg(help_heading = "Callers and Kubernetes")]
    pub kubernetes: KubeMode,
    /// Kubeconfig for the API server (default: in-cluster config).
    ///
    /// The API server for TokenReview and the pod index.
    #[arg(long, env = "KUBECONFIG")]
    #[arg(help_heading = "Callers and Kubernetes")]
    pub kubeconfig: Option<PathBuf>,
    /// Longest a successful TokenReview is reused (bounded by the token's own expiry; 0s disables).
    ///
    /// Where the pod index runs, a cached success is dropped, and the token reviewed again, once
    /// its bound pod or its ServiceAccount leaves the indexes, is replaced (another UID) or has
    /// been deleting past the API server's one-minute leeway, and while either index is stale. The
    /// ServiceAccount index runs beside the pod index (`list`/`watch` on serviceaccounts, metadata
    /// only).
    #[arg(long, env = "MESHCA_TOKEN_CACHE_TTL", default_value = "60s")]
    #[arg(help_heading = "Callers and Kubernetes")]
    pub token_cache_ttl: String,
    /// TokenReview deadline; a slow API server gives the client Unavailable.
    ///
    /// A timeout is never an allow.
    #[arg(long, env = "MESHCA_TOKENREVIEW_TIMEOUT", default_value = "5s")]
    #[arg(help_heading = "Callers and Kubernetes")]
    pub tokenreview_timeout: String,
    /// Longest a request that needs the pod index (local token verification,
    /// impersonation) waits for its first full list after a start, instead
    /// of being refused retryably; 0s refuses at once. Well below
    /// MESHCA_ADMISSION_MAX_WAIT, so the review and signing still fit after it.
    ///
    /// This covers the mTLS renewal pod check too. The retryable refusals are
    /// `token_local_index_not_synced`, `impersonation_index_not_ready` and
    /// `renewal_index_not_ready`; with `local-then-review` the token goes to TokenReview instead. A
    /// caller without `grpc-timeout` must still get its review and signature in after the wait. See
    /// the cold-restart storm in docs/BENCHMARKS.md.
    #[arg(long, env = "MESHCA_POD_INDEX_SYNC_WAIT", default_value = "3s")]
    #[arg(help_heading = "Callers and Kubernetes")]
    pub pod_index_sync_wait: String,
    #[command(flatten, next_help_heading = "Callers and Kubernetes")]
    pub token_review: crate::authn::args::TokenReviewArgs,
    /// Let mTLS-authenticated node proxies impersonate; their node is found by
    /// matching the connection's source IP to a running pod of the
    /// certificate's service account. Off by default (istiod never allows it).
    #[arg(long, env = "MESHCA_MTLS_IMPERSONATION", default_value_t = false, action = clap::ArgAction::Set)]
    #[arg(help_heading = "Callers and Kubernetes")]
    pub mtls_impersonation: bool,
    #[command(flatten, next_help_heading = "Audit log")]
    pub audit: crate::audit::settings::AuditArgs,
    /// Publish the root bundle as a ConfigMap into namespaces (as istiod and
    /// istio-csr do) so workloads can verify meshca's serving certificate.
    ///
    /// ConfigMap `istio-ca-root-cert` (key `root-cert.pem`, name from PILOT_CA_CERT_CONFIGMAP), as
    /// istiod does.
    #[arg(long, env = "MESHCA_PUBLISH_ROOT", default_value_t = false, action = clap::ArgAction::Set)]
    #[arg(help_heading = "Root publishing")]
    pub publish_root: bool,
    /// Label selector over namespaces for --publish-root (empty: all).
    ///
    /// Empty selects every namespace but kube-public and kube-node-lease.
    #[arg(
        long,
        env = "MESHCA_PUBLISH_ROOT_NAMESPACE_SELECTOR",
        default_value = ""
    )]
    #[arg(help_heading = "Root publishing")]
    pub publish_root_namespace_selector: String,
    /// Name of the published ConfigMap (data key `root-cert.pem`).
    #[arg(
        long,
        env = "PILOT_CA_CERT_CONFIGMAP",
        default_value = "istio-ca-root-cert"
    )]
    #[arg(help_heading = "Root publishing")]
    pub root_configmap: String,
    /// Full re-check period of the root publisher.
    #[arg(long, env = "MESHCA_PUBLISH_ROOT_RESYNC", default_value = "10m")]
    #[arg(help_heading = "Root publishing")]
    pub publish_root_resync: String,
    #[command(flatten, next_help_heading = "Transport limits")]
    pub limits: crate::transport::args::LimitArgs,
    /// Admission in front of signing (`admission` module).
    #[command(flatten, next_help_heading = "Admission and overload")]
    pub admission: crate::admission::AdmissionArgs,
    #[command(flatten, next_help_heading = "Kill switch")]
    pub kill_switch: crate::guards::KillSwitchArgs,
    #[command(flatten, next_help_heading = "Token verification")]
    pub token_verification: crate::authn::args::TokenVerificationArgs,
    #[command(flatten, next_help_heading = "Multiple clusters")]
    pub multicluster: crate::cluster::args::MultiClusterArgs,
    /// Phased CA rotation (`rotation` module).
    #[command(flatten, next_help_heading = "CA rotation")]
    pub rotation: crate::rotation::RotationArgs,
    /// Signing-key custody and two-tier issuing.
    #[command(flatten, next_help_heading = "Signing-key custody")]
    pub custody: crate::ca::custody::CustodyArgs,
    /// The PodCertificateRequest signer (`podcert` module).
    #[command(flatten, next_help_heading = "Pod certificates")]
    pub pod_certificates: crate::podcert::args::PodCertArgs,
    /// The standalone ClusterTrustBundle publisher (`ctb` module).
    #[command(flatten, next_help_heading = "ClusterTrustBundle")]
    pub cluster_trust_bundle: crate::ctb::CtbArgs,
}

impl ServeArgs {
    /// Where and how often a ConfigMap publisher writes `configmap_name`: the
    /// root and CRL publishers share the namespace selector and the resync.
    fn publisher(
        &self,
        configmap_name: String,
    ) -> Result<crate::rootpub::RootPublisherSettings, ConfigError> {
        let selector = self.publish_root_namespace_selector.trim();
        crate::rootpub::parse_selector(selector).map_err(|e| {
            err(
                "MESHCA_PUBLISH_ROOT_NAMESPACE_SELECTOR",
                selector,
                e.to_string(),
            )
        })?;
        Ok(crate::rootpub::RootPublisherSettings {
            configmap_name,
            namespace_selector: Some(selector.to_string()).filter(|s| !s.is_empty()),
            resync: self.publish_resync()?,
        })
    }

    /// The full re-check period every trust publisher uses (root and CRL
    /// ConfigMaps, ClusterTrustBundles).
    fn publish_resync(&self) -> Result<Duration, ConfigError> {
        bounded_duration(
            "MESHCA_PUBLISH_ROOT_RESYNC",
            &self.publish_root_resync,
            false,
            MAX_PERIOD,
        )
    }
}

/// Whether to talk to Kubernetes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KubeMode {
    Auto,
    On,
    Off,
}

/// Parsed, typed configuration of the server.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub ca_dir: PathBuf,
    pub trust_domain: TrustDomain,
    pub trust_domain_aliases: Vec<TrustDomain>,
    pub ttl: TtlPolicy,
    pub csr_policy: CsrPolicy,
    pub serving_names: Vec<String>,
    pub trusted_node_accounts: Vec<ServiceAccountRef>,
    pub token_audiences: Vec<String>,
    pub cluster_id: String,
    pub allow_root_change: bool,
    pub reload_poll: Duration,
    pub admin_listen: SocketAddr,
    pub kube: Option<KubeSettings>,
    pub mtls_impersonation: bool,
    pub audit: AuditSettings,
    /// Present when root publishing is on (requires Kubernetes).
    pub root_publisher: Option<crate::rootpub::RootPublisherSettings>,
    pub transport: TransportLimits,
    pub input: InputLimits,
    pub admin: AdminLimits,
    /// Admission in front of signing: slots, fair queue, shedding, identity caps.
    pub admission: crate::admission::AdmissionConfig,
    /// Bounded renewal, denylist, revocation.
    pub kill_switch: KillSwitchSettings,
    /// Remote clusters from Istio's remote secrets.
    pub multicluster: MultiClusterSettings,
    /// Phased CA rotation; present when MESHCA_ROTATION_NEXT_DIR is set.
    pub rotation: Option<crate::rotation::RotationSettings>,
    /// Where the signing key is held; two-tier issuing.
    pub custody: crate::ca::custody::CustodySettings,
    /// The PodCertificateRequest signer, when a signer name is set.
    pub pod_certificates: Option<crate::podcert::PodCertSettings>,
    /// The standalone ClusterTrustBundle publisher, when on.
    pub cluster_trust_bundle: Option<crate::ctb::CtbSettings>,
}

impl Config {
    /// All trust domains accepted: the mesh one first, then aliases.
    pub fn trust_domains(&self) -> Vec<TrustDomain> {
        let mut v = vec![self.trust_domain.clone()];
        v.extend(self.trust_domain_aliases.iter().cloned());
        v
    }

    /// What each cluster entry (local and remote) is built from.
    pub fn cluster_settings(&self) -> crate::cluster::args::ClusterSettings {
        crate::cluster::args::ClusterSettings {
            kube: self.kube.clone(),
            trusted_node_accounts: self.trusted_node_accounts.clone(),
            trust_domain: self.trust_domain.clone(),
            trust_domains: self.trust_domains(),
            token_audiences: self.token_audiences.clone(),
            mtls_impersonation: self.mtls_impersonation,
            max_index_staleness: self.kill_switch.renewal.max_index_staleness,
            renewal_pod_check: self.kill_switch.renewal_pod_check,
        }
    }

    /// What the issuer's guards (the kill switch) are built from.
    pub fn guard_settings(&self) -> crate::guards::GuardSettings {
        crate::guards::GuardSettings {
            kill_switch: self.kill_switch.clone(),
            pod_index_sync_wait: self
                .kube
                .as_ref()
                .map_or(Duration::ZERO, |k| k.pod_index_sync_wait),
            trust_domains: self.trust_domain_set(),
            cluster_id: self.cluster_id.clone(),
        }
    }

    /// The mesh trust domain and its aliases, for matching identities.
    pub fn trust_domain_set(&self) -> crate::identity::TrustDomains {
        crate::identity::TrustDomains::new(
            self.trust_domain.clone(),
            self.trust_domain_aliases.clone(),
        )
    }

    /// Parses flags. `ca_dir` is resolved by the caller (--dev uses its data
    /// dir); `in_cluster` says whether KUBERNETES_SERVICE_HOST is set.
    pub fn from_args(
        a: &ServeArgs,
        ca_dir: PathBuf,
        in_cluster: bool,
    ) -> Result<Self, ConfigError> {
        let host: [u8; 4] = if a.dev { [127, 0, 0, 1] } else { [0, 0, 0, 0] };
        let listen = a.listen.unwrap_or((host, 15012).into());
        let admin_listen = a.admin_listen.unwrap_or((host, 15014).into());
        let trust_domain = TrustDomain::new(&a.trust_domain)
            .map_err(|e| err("TRUST_DOMAIN", &a.trust_domain, e.to_string()))?;
        let trust_domain_aliases = list(&a.trust_domain_aliases)
            .map(|s| TrustDomain::new(s).map_err(|e| err("TRUST_DOMAIN_ALIASES", s, e.to_string())))
            .collect::<Result<_, _>>()?;
        // Every duration is bounded: an unbounded one overflows `now + d`
        // at the first request (TTLs) or in a background task (periods).
        let duration = |name, v: &str| bounded_duration(name, v, false, MAX_PERIOD);
        let ttl = TtlPolicy {
            default: bounded_duration(
                "DEFAULT_WORKLOAD_CERT_TTL",
                &a.default_ttl,
                false,
                MAX_TTL_LIMIT,
            )?,
            max: bounded_duration("MAX_WORKLOAD_CERT_TTL", &a.max_ttl, false, MAX_TTL_LIMIT)?,
            jitter: {
                let band = JitterBand::parse(&a.lifetime_jitter_band)
                    .map_err(|e| err("MESHCA_LIFETIME_JITTER_BAND", &a.lifetime_jitter_band, e))?;
                a.lifetime_jitter.then_some(band)
            },
        };
        let reload_poll = duration("MESHCA_RELOAD_POLL", &a.reload_poll)?;
        let mut serving_names: Vec<String> = list(&a.serving_names).map(str::to_string).collect();
        // Istio's CA client verifies istiod.istio-system.svc when CA_ADDR contains "localhost".
        if a.dev && !serving_names.iter().any(|n| n == "istiod.istio-system.svc") {
            serving_names.push("istiod.istio-system.svc".into());
        }
        if serving_names.is_empty() {
            return Err(err(
                "MESHCA_SERVING_NAMES",
                &a.serving_names,
                "at least one name is required",
            ));
        }
        let token_audiences: Vec<String> = list(&a.token_audiences).map(str::to_string).collect();
        if token_audiences.is_empty() {
            return Err(err(
                "TOKEN_AUDIENCES",
                &a.token_audiences,
                "at least one audience is required",
            ));
        }
        let kube_on = match a.kubernetes {
            KubeMode::On => true,
            KubeMode::Off => false,
            // Dev mode is for a laptop: only a kubeconfig given on its
            // command line turns Kubernetes on there (`main` drops one that
            // came from an exported KUBECONFIG).
            KubeMode::Auto => a.kubeconfig.is_some() || (in_cluster && !a.dev),
        };
        if !kube_on && a.token_verification.token_verification.uses_local() {
            return Err(err(
                "MESHCA_TOKEN_VERIFICATION",
                a.token_verification.token_verification.as_str(),
                "local verification needs Kubernetes (MESHCA_KUBERNETES)",
            ));
        }
        let kube = if kube_on {
            let tokenreview_timeout =
                duration("MESHCA_TOKENREVIEW_TIMEOUT", &a.tokenreview_timeout)?;
            Some(KubeSettings {
                token_verification: a.token_verification.parse(tokenreview_timeout)?,
                kubeconfig: a.kubeconfig.clone(),
                token_cache_ttl: bounded_duration(
                    "MESHCA_TOKEN_CACHE_TTL",
                    &a.token_cache_ttl,
                    true,
                    MAX_PERIOD,
                )?,
                tokenreview_timeout,
                review_limits: a.token_review.parse()?,
                pod_index_sync_wait: bounded_duration(
                    "MESHCA_POD_INDEX_SYNC_WAIT",
                    &a.pod_index_sync_wait,
                    true,
                    Duration::from_secs(60),
                )?,
            })
        } else {
            None
        };
        let audit = a.audit.parse()?;
        if let Some((ns, name)) = &audit.checkpoint_key_secret {
            let v = format!("{ns}/{name}");
            if kube.is_none() {
                return Err(err(
                    "MESHCA_AUDIT_CHECKPOINT_KEY_SECRET",
                    &v,
                    "a checkpoint key Secret needs Kubernetes (a kubeconfig or in-cluster config)",
                ));
            }
            if audit.checkpoint_key.is_some() {
                return Err(err(
                    "MESHCA_AUDIT_CHECKPOINT_KEY_SECRET",
                    &v,
                    "set either the key file (MESHCA_AUDIT_CHECKPOINT_KEY) or the Secret, not both",
                ));
            }
        }
        if audit.anchor.is_some() && kube.is_none() {
            return Err(err(
                "MESHCA_AUDIT_ANCHOR",
                "true",
                "anchoring audit checkpoints needs Kubernetes (a kubeconfig or in-cluster config)",
            ));
        }
        let root_publisher = if a.publish_root {
            if kube.is_none() {
                return Err(err(
                    "MESHCA_PUBLISH_ROOT",
                    "true",
                    "root publishing needs Kubernetes (a kubeconfig or in-cluster config)",
                ));
            }
            if a.root_configmap.is_empty() {
                return Err(err("PILOT_CA_CERT_CONFIGMAP", "", "must not be empty"));
            }
            Some(a.publisher(a.root_configmap.clone())?)
        } else {
            None
        };
        let (transport, input, admin) = a.limits.parse()?;
        let admission = a.admission.parse()?;
        let kill_switch = a
            .kill_switch
            .parse(ttl.default, kube.is_some(), |name| a.publisher(name))?;
        let multicluster = a.multicluster.parse(kube.is_some())?;
        let rotation = a.rotation.parse(duration)?;
        let custody = a.custody.parse()?;
        // Rotation works with every signer and with two-tier issuing: each
        // generation names its key (a key file, or `ca-key.uri` in a token,
        // ca::custody::choose_key) and every phase re-mints the issuing CA
        // (rotation::Install).
        let mut pod_certificates = a
            .pod_certificates
            .parse(kube.is_some(), || a.publish_resync())?;
        let cluster_trust_bundle = a
            .cluster_trust_bundle
            .parse(kube.is_some(), || a.publish_resync())?;
        // One writer per bundle: the standalone publisher (fed every root of
        // a rotation) takes over a bundle the signer would also write.
        if let Some(pc) = pod_certificates.as_mut() {
            pc.trust_bundle = crate::ctb::signer_publishes(
                pc.trust_bundle,
                &crate::podcert::trust_bundle_name(&pc.signer_name),
                cluster_trust_bundle.as_ref(),
            );
        }
        Ok(Self {
            cluster_trust_bundle,
            custody,
            multicluster,
            rotation,
            pod_certificates,
            admission,
            kill_switch,
            transport,
            input,
            admin,
            root_publisher,
            audit,
            admin_listen,
            kube,
            mtls_impersonation: a.mtls_impersonation,
            listen,
            ca_dir,
            trust_domain,
            trust_domain_aliases,
            ttl,
            csr_policy: a.csr_policy,
            serving_names,
            trusted_node_accounts: parse_service_accounts(&a.trusted_node_accounts)?,
            token_audiences,
            cluster_id: a.cluster_id.clone(),
            allow_root_change: a.multiroot,
            reload_poll,
        })
    }
}

/// A flag error as the command line spells it, `invalid --default-ttl
/// (DEFAULT_WORKLOAD_CERT_TTL)="abc": ...`: settings are checked by their
/// variable's name, and a user typed the flag.
pub fn flag_error(e: &ConfigError) -> String {
    let cmd = <ServeArgs as clap::Args>::augment_args(clap::Command::new("serve"));
    let flag = cmd
        .get_arguments()
        .find(|a| a.get_env().is_some_and(|v| v == e.name))
        .and_then(|a| a.get_long());
    match flag {
        Some(long) => format!("invalid --{long} ({})={:?}: {}", e.name, e.value, e.reason),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authn::local::TokenVerificationMode;
    use crate::authn::token::ReviewLimits;
    use clap::Parser;
    use test_case::test_case;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        let cli =
            Cli::try_parse_from(std::iter::once("meshca").chain(args.iter().copied())).unwrap();
        Config::from_args(&cli.serve, "/tmp/ca".into(), false)
    }

    #[test_case(&["--default-ttl", "abc"], "invalid --default-ttl (DEFAULT_WORKLOAD_CERT_TTL)=\"abc\"" ; "ttl")]
    #[test_case(&["--reload-poll", "0s"], "invalid --reload-poll (MESHCA_RELOAD_POLL)=\"0s\"" ; "period")]
    fn flag_errors_name_the_flag(args: &[&str], want: &str) {
        let msg = flag_error(&parse(args).unwrap_err());
        assert!(msg.starts_with(want), "{msg}");
    }

    #[test]
    fn dev_mode_touches_no_cluster_unless_asked() {
        let cli = Cli::try_parse_from(["meshca", "--dev"]).unwrap();
        let in_cluster = Config::from_args(&cli.serve, "/tmp/ca".into(), true).unwrap();
        assert!(
            in_cluster.kube.is_none(),
            "an in-cluster environment is ignored"
        );
        let asked = parse(&["--dev", "--kubeconfig", "/k"]).unwrap();
        assert!(asked.kube.is_some(), "--kubeconfig asks for it");
        let on = Cli::try_parse_from(["meshca", "--dev", "--kubernetes", "on"]).unwrap();
        assert!(Config::from_args(&on.serve, "/tmp/ca".into(), true)
            .unwrap()
            .kube
            .is_some());
    }

    #[test]
    fn defaults_match_istiod() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.trust_domain.as_str(), "cluster.local");
        assert_eq!(c.ttl, TtlPolicy::default());
        assert_eq!(c.token_audiences, vec!["istio-ca"]);
        assert_eq!(c.cluster_id, "Kubernetes");
        assert!(c.trusted_node_accounts.is_empty());
        assert_eq!(c.csr_policy, CsrPolicy::Strict);
        assert_eq!(c.listen.to_string(), "0.0.0.0:15012");
        assert_eq!(c.admin_listen.to_string(), "0.0.0.0:15014");
        assert!(c.kube.is_none() && !c.mtls_impersonation);
    }

    /// Auditing cannot be switched off by env or chart: the null sink takes
    /// a flag that has no env var.
    #[test]
    fn null_audit_sink_needs_the_benchmark_flag() {
        let e = parse(&["--audit-sink", "null"]).unwrap_err();
        assert!(e.to_string().contains("--audit-null-for-benchmarks"), "{e}");
        let c = parse(&["--audit-sink", "null", "--audit-null-for-benchmarks"]).unwrap();
        assert_eq!(c.audit.sink, AuditSinkKind::Null);
        assert_eq!(parse(&[]).unwrap().audit.sink, AuditSinkKind::Stdout);
    }

    #[test]
    fn dev_binds_loopback_and_kube_follows_mode() {
        let c = parse(&["--dev"]).unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:15012");
        assert!(parse(&["--kubeconfig", "/k"]).unwrap().kube.is_some());
        assert!(parse(&["--kubernetes", "on"]).unwrap().kube.is_some());
        assert!(parse(&["--kubernetes", "off", "--kubeconfig", "/k"])
            .unwrap()
            .kube
            .is_none());
    }

    #[test]
    fn tokenreview_limits_default_and_parse() {
        let k = parse(&["--kubernetes", "on"]).unwrap().kube.unwrap();
        assert_eq!(k.review_limits, ReviewLimits::default());
        let k = parse(&[
            "--kubernetes",
            "on",
            "--tokenreview-qps",
            "20",
            "--tokenreview-burst",
            "5",
            "--tokenreview-max-inflight",
            "4",
            "--tokenreview-max-wait",
            "250ms",
            "--token-negative-cache-ttl",
            "0s",
        ])
        .unwrap()
        .kube
        .unwrap();
        let l = k.review_limits;
        assert_eq!((l.qps, l.burst, l.max_inflight), (20, 5, 4));
        assert_eq!(l.negative_ttl, Duration::ZERO);
    }

    #[test]
    fn token_verification_defaults_to_review_and_parses() {
        let k = parse(&["--kubernetes", "on"]).unwrap().kube.unwrap();
        assert_eq!(k.token_verification, TokenVerification::default());
        let k = parse(&[
            "--kubernetes",
            "on",
            "--token-verification",
            "local-then-review",
            "--token-require-pod-binding",
            "true",
            "--jwks-refresh-interval",
            "5m",
            "--jwks-min-refresh-interval",
            "10s",
            "--tokenreview-timeout",
            "2s",
        ])
        .unwrap()
        .kube
        .unwrap();
        let t = k.token_verification;
        assert_eq!(t.mode, TokenVerificationMode::LocalThenReview);
        assert!(t.require_pod_binding);
        assert_eq!(
            (
                t.refresh.interval,
                t.refresh.min_interval,
                t.refresh.timeout
            ),
            (
                Duration::from_secs(300),
                Duration::from_secs(10),
                Duration::from_secs(2)
            )
        );
    }

    #[test]
    fn jitter_is_on_by_default_and_can_be_turned_off() {
        assert_eq!(parse(&[]).unwrap().ttl.jitter, Some(JitterBand::DEFAULT));
        assert_eq!(
            parse(&["--lifetime-jitter-band", "80-95"])
                .unwrap()
                .ttl
                .jitter,
            Some(JitterBand::new(80, 95).unwrap())
        );
        assert_eq!(
            parse(&["--lifetime-jitter", "false"]).unwrap().ttl.jitter,
            None
        );
    }

    #[test]
    fn parses_typed_values() {
        let c = parse(&[
            "--trusted-node-accounts",
            "istio-system/ztunnel, kube-system/ztunnel",
            "--max-ttl",
            "48h",
            "--trust-domain-aliases",
            "old.local",
        ])
        .unwrap();
        assert_eq!(c.trusted_node_accounts.len(), 2);
        assert_eq!(
            c.trusted_node_accounts[1].to_string(),
            "kube-system/ztunnel"
        );
        assert_eq!(c.ttl.max, Duration::from_secs(48 * 3600));
        assert_eq!(c.trust_domains().len(), 2);
    }

    #[test_case(&["--trusted-node-accounts", "ztunnel"], "CA_TRUSTED_NODE_ACCOUNTS" ; "no slash")]
    #[test_case(&["--trusted-node-accounts", "a/b/c"], "CA_TRUSTED_NODE_ACCOUNTS" ; "two slashes")]
    #[test_case(&["--default-ttl", "forever"], "DEFAULT_WORKLOAD_CERT_TTL" ; "bad duration")]
    #[test_case(&["--max-ttl", "0s"], "MAX_WORKLOAD_CERT_TTL" ; "zero max")]
    #[test_case(&["--kubernetes", "on", "--tokenreview-qps", "0"], "MESHCA_TOKENREVIEW_QPS" ; "zero qps")]
    #[test_case(&["--kubernetes", "on", "--tokenreview-max-inflight", "0"], "MESHCA_TOKENREVIEW_MAX_INFLIGHT" ; "zero inflight")]
    #[test_case(&["--kubernetes", "on", "--tokenreview-max-wait", "soon"], "MESHCA_TOKENREVIEW_MAX_WAIT" ; "bad wait")]
    #[test_case(&["--kubernetes", "on", "--tokenreview-max-wait", "1000000000h"], "MESHCA_TOKENREVIEW_MAX_WAIT" ; "wait beyond a day")]
    #[test_case(&["--kubernetes", "on", "--token-negative-cache-ttl", "1000000000h"], "MESHCA_TOKEN_NEGATIVE_CACHE_TTL" ; "negative ttl beyond a day")]
    #[test_case(&["--kubernetes", "on", "--token-negative-cache-size", "0"], "MESHCA_TOKEN_NEGATIVE_CACHE_SIZE" ; "zero negative cache")]
    #[test_case(&["--lifetime-jitter-band", "10-100"], "MESHCA_LIFETIME_JITTER_BAND" ; "band too wide")]
    #[test_case(&["--lifetime-jitter", "false", "--lifetime-jitter-band", "x"], "MESHCA_LIFETIME_JITTER_BAND" ; "bad band even when off")]
    #[test_case(&["--trust-domain", "a b"], "TRUST_DOMAIN" ; "bad trust domain")]
    #[test_case(&["--token-audiences", ","], "TOKEN_AUDIENCES" ; "no audience")]
    #[test_case(&["--publish-root", "true"], "MESHCA_PUBLISH_ROOT" ; "publishing without kubernetes")]
    #[test_case(&["--kubernetes", "on", "--audit-anchor", "true", "--audit-anchor-interval", "500ms"], "MESHCA_AUDIT_ANCHOR_INTERVAL" ; "anchor interval under a second")]
    #[test_case(&["--kubernetes", "on", "--audit-anchor", "true", "--audit-anchor-interval", "25h"], "MESHCA_AUDIT_ANCHOR_INTERVAL" ; "anchor interval over a day")]
    #[test_case(&["--kubernetes", "on", "--audit-anchor", "true", "--audit-anchor-configmap", "Anchors"], "MESHCA_AUDIT_ANCHOR_CONFIGMAP" ; "anchor set not a dns name")]
    #[test_case(&["--audit-checkpoint-key-secret", "ns/key"], "MESHCA_AUDIT_CHECKPOINT_KEY_SECRET" ; "key secret without kubernetes")]
    #[test_case(&["--kubernetes", "on", "--audit-checkpoint-key-secret", "key"], "MESHCA_AUDIT_CHECKPOINT_KEY_SECRET" ; "key secret without a namespace")]
    #[test_case(&["--kubernetes", "on", "--audit-checkpoint-key-secret", "ns/key", "--audit-checkpoint-key", "/k.pem"], "MESHCA_AUDIT_CHECKPOINT_KEY_SECRET" ; "key secret and key file")]
    #[test_case(&["--token-verification", "local"], "MESHCA_TOKEN_VERIFICATION" ; "local verification without kubernetes")]
    #[test_case(&["--kubernetes", "on", "--jwks-min-refresh-interval", "0s"], "MESHCA_JWKS_MIN_REFRESH_INTERVAL" ; "zero jwks min interval")]
    #[test_case(&["--kubernetes", "on", "--jwks-refresh-interval", "1m", "--jwks-min-refresh-interval", "2m"], "MESHCA_JWKS_MIN_REFRESH_INTERVAL" ; "min above periodic")]
    #[test_case(&["--kubernetes", "on", "--jwks-refresh-interval", "1000000h"], "MESHCA_JWKS_REFRESH_INTERVAL" ; "huge jwks interval")]
    #[test_case(&["--kubernetes", "on", "--jwks-max-age", "0s"], "MESHCA_JWKS_MAX_AGE" ; "zero jwks max age")]
    #[test_case(&["--kubernetes", "on", "--jwks-max-age", "10m"], "MESHCA_JWKS_MAX_AGE" ; "max age leaves no retry after the periodic fetch")]
    #[test_case(&["--kubernetes", "on", "--jwks-refresh-interval", "1h"], "MESHCA_JWKS_MAX_AGE" ; "periodic fetch beyond the default max age")]
    #[test_case(&["--publish-root", "true", "--kubernetes", "on", "--publish-root-namespace-selector", "a in (b"], "MESHCA_PUBLISH_ROOT_NAMESPACE_SELECTOR" ; "bad selector")]
    fn rejects_with_variable_name(args: &[&str], name: &str) {
        assert_eq!(parse(args).unwrap_err().name, name);
    }
}

#[cfg(test)]
mod limit_tests {
    use super::*;
    use clap::Parser;
    use test_case::test_case;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        let cli = Cli::try_parse_from(std::iter::once("meshca").chain(args.iter().copied()))
            .expect("clap accepts the syntax");
        Config::from_args(&cli.serve, "/tmp/ca".into(), false)
    }

    #[test]
    fn limit_defaults_are_the_documented_ones() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.transport, TransportLimits::default());
        assert_eq!(c.input, InputLimits::default());
        assert_eq!(c.admin, AdminLimits::default());
    }

    #[test]
    fn zero_disables_keepalive_and_connection_age() {
        let c = parse(&["--keepalive-interval", "0s", "--max-connection-age", "0s"]).unwrap();
        assert!(
            c.transport.keepalive_interval.is_zero() && c.transport.max_connection_age.is_zero()
        );
    }

    // Each would panic or overflow at a later request or in a background task,
    // or make the server unusable: refused at startup, naming the variable.
    #[test_case(&["--max-ttl", "1000000000h"], "MAX_WORKLOAD_CERT_TTL" ; "max ttl beyond time range")]
    #[test_case(&["--max-ttl", "876001h"], "MAX_WORKLOAD_CERT_TTL" ; "max ttl over 100 years")]
    #[test_case(&["--default-ttl", "99999999999h"], "DEFAULT_WORKLOAD_CERT_TTL" ; "default ttl beyond time range")]
    #[test_case(&["--default-ttl", "0s"], "DEFAULT_WORKLOAD_CERT_TTL" ; "zero default ttl")]
    #[test_case(&["--default-ttl", "5124095576030431h"], "DEFAULT_WORKLOAD_CERT_TTL" ; "overflowing u64 seconds")]
    #[test_case(&["--reload-poll", "0s"], "MESHCA_RELOAD_POLL" ; "zero reload poll")]
    #[test_case(&["--reload-poll", "100000h"], "MESHCA_RELOAD_POLL" ; "huge reload poll")]
    #[test_case(&["--kubernetes", "on", "--token-cache-ttl", "1000000000h"], "MESHCA_TOKEN_CACHE_TTL" ; "huge token cache ttl")]
    #[test_case(&["--kubernetes", "on", "--tokenreview-timeout", "0s"], "MESHCA_TOKENREVIEW_TIMEOUT" ; "zero tokenreview timeout")]
    #[test_case(&["--kubernetes", "on", "--tokenreview-timeout", "1000000h"], "MESHCA_TOKENREVIEW_TIMEOUT" ; "huge tokenreview timeout")]
    #[test_case(&["--audit-checkpoint-interval", "0s"], "MESHCA_AUDIT_CHECKPOINT_INTERVAL" ; "zero checkpoint interval")]
    #[test_case(&["--audit-checkpoint-interval", "1000000h"], "MESHCA_AUDIT_CHECKPOINT_INTERVAL" ; "huge checkpoint interval")]
    #[test_case(&["--audit-checkpoint-every", "0"], "MESHCA_AUDIT_CHECKPOINT_EVERY" ; "zero checkpoint every")]
    #[test_case(&["--audit-max-files", "0"], "MESHCA_AUDIT_MAX_FILES" ; "zero audit files")]
    #[test_case(&["--audit-handshake-interval", "0s"], "MESHCA_AUDIT_HANDSHAKE_INTERVAL" ; "zero handshake audit interval")]
    #[test_case(&["--audit-handshake-interval", "500ms"], "MESHCA_AUDIT_HANDSHAKE_INTERVAL" ; "sub second handshake audit interval")]
    #[test_case(&["--audit-handshake-interval", "2h"], "MESHCA_AUDIT_HANDSHAKE_INTERVAL" ; "huge handshake audit interval")]
    #[test_case(&["--audit-handshake-max-sources", "0"], "MESHCA_AUDIT_HANDSHAKE_MAX_SOURCES" ; "zero handshake audit sources")]
    #[test_case(&["--audit-max-files", "4294967295"], "MESHCA_AUDIT_MAX_FILES" ; "audit files loop forever")]
    #[test_case(&["--publish-root", "true", "--kubernetes", "on", "--publish-root-resync", "1000000h"], "MESHCA_PUBLISH_ROOT_RESYNC" ; "huge resync")]
    #[test_case(&["--max-connections", "0"], "MESHCA_MAX_CONNECTIONS" ; "zero connections")]
    #[test_case(&["--max-connections-per-ip", "0"], "MESHCA_MAX_CONNECTIONS_PER_IP" ; "zero per ip")]
    #[test_case(&["--max-pending-handshakes", "0"], "MESHCA_MAX_PENDING_HANDSHAKES" ; "zero handshakes")]
    #[test_case(&["--max-pending-handshakes", "100000000"], "MESHCA_MAX_PENDING_HANDSHAKES" ; "handshakes over semaphore range")]
    #[test_case(&["--max-pending-handshakes-per-ip", "0"], "MESHCA_MAX_PENDING_HANDSHAKES_PER_IP" ; "zero handshakes per ip")]
    #[test_case(&["--max-inflight-requests-per-ip", "0"], "MESHCA_MAX_INFLIGHT_REQUESTS_PER_IP" ; "zero inflight per ip")]
    #[test_case(&["--admin-max-connections-per-ip", "0"], "MESHCA_ADMIN_MAX_CONNECTIONS_PER_IP" ; "zero admin per ip")]
    #[test_case(&["--handshake-timeout", "0s"], "MESHCA_HANDSHAKE_TIMEOUT" ; "zero handshake timeout")]
    #[test_case(&["--handshake-timeout", "1h"], "MESHCA_HANDSHAKE_TIMEOUT" ; "long handshake timeout")]
    #[test_case(&["--max-concurrent-streams", "0"], "MESHCA_MAX_CONCURRENT_STREAMS" ; "zero streams")]
    #[test_case(&["--max-inflight-requests", "0"], "MESHCA_MAX_INFLIGHT_REQUESTS" ; "zero inflight")]
    #[test_case(&["--max-inflight-requests", "100000000"], "MESHCA_MAX_INFLIGHT_REQUESTS" ; "inflight over semaphore range")]
    #[test_case(&["--max-queued-requests", "100000000"], "MESHCA_MAX_QUEUED_REQUESTS" ; "huge queue")]
    #[test_case(&["--request-timeout", "0s"], "MESHCA_REQUEST_TIMEOUT" ; "zero request timeout")]
    #[test_case(&["--request-timeout", "1000000h"], "MESHCA_REQUEST_TIMEOUT" ; "huge request timeout")]
    #[test_case(&["--max-header-list-bytes", "100"], "MESHCA_MAX_HEADER_LIST_BYTES" ; "tiny header list")]
    #[test_case(&["--http2-stream-window-bytes", "0"], "MESHCA_HTTP2_STREAM_WINDOW_BYTES" ; "zero stream window")]
    #[test_case(&["--http2-stream-window-bytes", "4294967295"], "MESHCA_HTTP2_STREAM_WINDOW_BYTES" ; "stream window over http2 max")]
    #[test_case(&["--http2-connection-window-bytes", "2147483648"], "MESHCA_HTTP2_CONNECTION_WINDOW_BYTES" ; "connection window over http2 max")]
    #[test_case(&["--keepalive-interval", "1000000h"], "MESHCA_KEEPALIVE_INTERVAL" ; "huge keepalive")]
    #[test_case(&["--keepalive-timeout", "0s"], "MESHCA_KEEPALIVE_TIMEOUT" ; "zero keepalive timeout")]
    #[test_case(&["--max-connection-age", "1000000h"], "MESHCA_MAX_CONNECTION_AGE" ; "huge connection age")]
    #[test_case(&["--max-connection-age-grace", "1000000h"], "MESHCA_MAX_CONNECTION_AGE_GRACE" ; "huge grace")]
    #[test_case(&["--max-cancelled-streams-per-second", "0"], "MESHCA_MAX_CANCELLED_STREAMS_PER_SECOND" ; "zero cancels")]
    #[test_case(&["--max-request-bytes", "1000"], "MESHCA_MAX_REQUEST_BYTES" ; "message smaller than a csr")]
    #[test_case(&["--max-request-bytes", "104857600"], "MESHCA_MAX_REQUEST_BYTES" ; "message over istiod max")]
    #[test_case(&["--max-token-bytes", "10"], "MESHCA_MAX_TOKEN_BYTES" ; "tiny token")]
    #[test_case(&["--max-token-bytes", "40000"], "MESHCA_MAX_TOKEN_BYTES" ; "token over header list")]
    #[test_case(&["--max-cluster-id-bytes", "0"], "MESHCA_MAX_CLUSTER_ID_BYTES" ; "zero cluster id")]
    #[test_case(&["--max-metadata-value-bytes", "10"], "MESHCA_MAX_METADATA_VALUE_BYTES" ; "metadata below a spiffe id")]
    #[test_case(&["--max-metadata-keys", "1"], "MESHCA_MAX_METADATA_KEYS" ; "fewer keys than istio sends")]
    #[test_case(&["--admin-max-connections", "0"], "MESHCA_ADMIN_MAX_CONNECTIONS" ; "zero admin connections")]
    #[test_case(&["--admin-header-timeout", "0s"], "MESHCA_ADMIN_HEADER_TIMEOUT" ; "zero admin header timeout")]
    #[test_case(&["--admin-connection-timeout", "1000000h"], "MESHCA_ADMIN_CONNECTION_TIMEOUT" ; "huge admin timeout")]
    #[test_case(&["--remote-secrets", "true"], "MESHCA_REMOTE_SECRETS" ; "remote secrets without kubernetes")]
    #[test_case(&["--kubernetes", "on", "--remote-secrets", "true", "--remote-secrets-namespace", " "], "MESHCA_REMOTE_SECRETS_NAMESPACE" ; "empty remote secrets namespace")]
    #[test_case(&["--kubernetes", "on", "--remote-secrets", "true", "--remote-clusters-max", "0"], "MESHCA_REMOTE_CLUSTERS_MAX" ; "zero remote clusters")]
    #[test_case(&["--kubernetes", "on", "--remote-secrets", "true", "--remote-cluster-sync-timeout", "0s"], "MESHCA_REMOTE_CLUSTER_SYNC_TIMEOUT" ; "zero sync timeout")]
    fn refuses_at_startup_naming_the_variable(args: &[&str], name: &str) {
        let e = parse(args).unwrap_err();
        assert_eq!(e.name, name, "{e}");
        assert!(e.to_string().contains(name));
    }

    #[test]
    fn remote_secrets_are_off_by_default_and_parse() {
        assert!(parse(&[]).unwrap().multicluster.remote_secrets.is_none());
        let c = parse(&[
            "--kubernetes",
            "on",
            "--remote-secrets",
            "true",
            "--remote-secrets-namespace",
            "mesh",
            "--remote-kubeconfig-options",
            "exec, tokenFile",
        ])
        .unwrap();
        let r = c.multicluster.remote_secrets.unwrap();
        assert_eq!(r.namespace, "mesh");
        assert_eq!(
            r.policy
                .allow
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
            ["exec", "tokenFile"]
        );
        assert_eq!((r.max_clusters, r.sync_timeout.as_secs()), (64, 30));
    }

    #[test]
    fn the_largest_accepted_ttl_cannot_overflow_a_validity() {
        let c = parse(&["--max-ttl", "876000h", "--default-ttl", "876000h"]).unwrap();
        let end = time::OffsetDateTime::now_utc() + time::Duration::days(365 * 200);
        let v = crate::ca::ttl::validity(
            time::OffsetDateTime::now_utc(),
            c.ttl.max.as_secs() as i64,
            &c.ttl,
            end,
        )
        .unwrap();
        assert!(!v.clamped);
        crate::ca::ttl::validity(time::OffsetDateTime::now_utc(), 0, &c.ttl, end).unwrap();
    }

    #[test]
    fn cluster_trust_bundle_option() {
        assert!(parse(&[]).unwrap().cluster_trust_bundle.is_none());
        let e = parse(&["--publish-cluster-trust-bundle", "true"]).unwrap_err();
        assert!(e.to_string().contains("needs Kubernetes"), "{e}");
        let k = [
            "--kubeconfig",
            "/k",
            "--publish-cluster-trust-bundle",
            "true",
        ];
        let c = parse(&k).unwrap().cluster_trust_bundle.unwrap();
        assert_eq!(c.signer_name, "istio.io/istiod-ca");
        assert_eq!(c.name, "istio.io:istiod-ca:root-cert");
        let mut named = k.to_vec();
        named.extend(["--cluster-trust-bundle-name", "istio.io:istiod-ca:mesh"]);
        assert_eq!(
            parse(&named).unwrap().cluster_trust_bundle.unwrap().name,
            "istio.io:istiod-ca:mesh"
        );
        let mut bad = k.to_vec();
        bad.extend(["--cluster-trust-bundle-name", "other:root-cert"]);
        let e = parse(&bad).unwrap_err();
        assert!(
            e.to_string().contains("MESHCA_CLUSTER_TRUST_BUNDLE_NAME"),
            "{e}"
        );
        let mut bad = k.to_vec();
        bad.extend(["--cluster-trust-bundle-signer", "kubernetes.io/x"]);
        assert!(parse(&bad).is_err());
        // The pod-certificate signer on the same signer name leaves the
        // bundle to the standalone publisher; on another name it keeps its own.
        let mut both = k.to_vec();
        both.extend(["--pod-certificate-signer", "istio.io/istiod-ca"]);
        let c = parse(&both).unwrap();
        assert!(!c.pod_certificates.unwrap().trust_bundle);
        let mut apart = k.to_vec();
        apart.extend(["--pod-certificate-signer", "meshca.io/spiffe"]);
        assert!(
            parse(&apart)
                .unwrap()
                .pod_certificates
                .unwrap()
                .trust_bundle
        );
    }
}

#[cfg(test)]
mod rotation_custody_tests {
    use super::*;
    use clap::Parser;
    use test_case::test_case;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    const URI: &str = "pkcs11:token=mesh;object=ica-1?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/run/pin";

    // Phased rotation was refused with two-tier issuing or a token key; it
    // now runs with every combination (the staged generation names its
    // token key in its own directory, checked when it is read).
    #[test_case(&[], false, false ; "file signer, direct")]
    #[test_case(&["--issuing-ca", "on"], true, false ; "file signer, two-tier")]
    #[test_case(&["--signer", URI], true, true ; "pkcs11, two-tier by default")]
    #[test_case(&["--signer", URI, "--issuing-ca", "off"], false, true ; "pkcs11, direct")]
    fn rotation_runs_with_every_signer_and_two_tier(extra: &[&str], two_tier: bool, token: bool) {
        let args = ["meshca", "--rotation-next-dir", "/run/next"]
            .into_iter()
            .chain(extra.iter().copied());
        let cli = Cli::try_parse_from(args).expect("clap accepts the syntax");
        let c = Config::from_args(&cli.serve, "/tmp/ca".into(), false).unwrap();
        assert!(c.rotation.is_some());
        assert_eq!(c.custody.issuing_ttl.is_some(), two_tier);
        assert_eq!(
            matches!(c.custody.signer, crate::ca::custody::SignerSpec::Pkcs11(_)),
            token
        );
    }
}
