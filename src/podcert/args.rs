//! Flags of the PodCertificateRequest signer.

use std::time::Duration;

use crate::ca::ttl::JitterBand;
use crate::flags::{bounded, bounded_duration, err, ConfigError};

/// The PodCertificateRequest signer (kubelet-projected pod certificates); off unless a signer name is set.
#[derive(Debug, Clone, clap::Args)]
pub struct PodCertArgs {
    /// Sign PodCertificateRequests for this domain-prefixed signer name
    /// (e.g. `meshca.io/spiffe`); no default: the signer is off. Needs
    /// Kubernetes and the pod index.
    ///
    /// See docs/pod-certificates.md.
    #[arg(long, env = "MESHCA_POD_CERTIFICATE_SIGNER")]
    pub pod_certificate_signer: Option<String>,
    /// Lifetime of a pod certificate, cut to the request's
    /// maxExpirationSeconds and never under 1h.
    ///
    /// At most 91 days.
    #[arg(long, env = "MESHCA_POD_CERTIFICATE_LIFETIME", default_value = "24h")]
    pub pod_certificate_lifetime: String,
    /// Where beginRefreshAt falls, as MIN-MAX percent of the lifetime (drawn
    /// per certificate so pods started together renew apart).
    ///
    /// Kept 10 minutes inside the validity.
    #[arg(
        long,
        env = "MESHCA_POD_CERTIFICATE_REFRESH_BAND",
        default_value = "50-75"
    )]
    pub pod_certificate_refresh_band: String,
    /// How long a request for a pod the pod index does not show (or shows
    /// with another UID) is waited for before it is denied.
    ///
    /// Then the request is `Denied`. At most 1h.
    #[arg(long, env = "MESHCA_POD_CERTIFICATE_POD_WAIT", default_value = "30s")]
    pub pod_certificate_pod_wait: String,
    /// Requests signed and written concurrently.
    ///
    /// 1 to 1024. Each waits mostly on its status PUT, so a burst needs many (docs/BENCHMARKS.md,
    /// PodCertificateRequest burst).
    #[arg(long, env = "MESHCA_POD_CERTIFICATE_WORKERS", default_value_t = 32)]
    pub pod_certificate_workers: usize,
    /// Publish the root bundle as the signer-linked ClusterTrustBundle
    /// `<signer with / as :>:root-cert`.
    ///
    /// Only with the signer on; re-checked every MESHCA_PUBLISH_ROOT_RESYNC.
    #[arg(long, env = "MESHCA_POD_CERTIFICATE_TRUST_BUNDLE", default_value_t = true, action = clap::ArgAction::Set)]
    pub pod_certificate_trust_bundle: bool,
}

impl PodCertArgs {
    pub fn parse(
        &self,
        kube_on: bool,
        publish_resync: impl FnOnce() -> Result<Duration, ConfigError>,
    ) -> Result<Option<super::PodCertSettings>, ConfigError> {
        let Some(name) = self
            .pod_certificate_signer
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
        else {
            return Ok(None);
        };
        let signer_name = super::parse_signer_name(name)
            .map_err(|e| err("MESHCA_POD_CERTIFICATE_SIGNER", name, e.detail))?;
        if !kube_on {
            return Err(err(
                "MESHCA_POD_CERTIFICATE_SIGNER",
                name,
                "needs Kubernetes (a kubeconfig or in-cluster config)",
            ));
        }
        let lifetime = bounded_duration(
            "MESHCA_POD_CERTIFICATE_LIFETIME",
            &self.pod_certificate_lifetime,
            false,
            Duration::from_secs(7_862_400),
        )?;
        if lifetime < super::decide::MIN_LIFETIME {
            return Err(err(
                "MESHCA_POD_CERTIFICATE_LIFETIME",
                &self.pod_certificate_lifetime,
                "must be at least 1h (the API's minimum)",
            ));
        }
        let refresh_band = JitterBand::parse(&self.pod_certificate_refresh_band).map_err(|e| {
            err(
                "MESHCA_POD_CERTIFICATE_REFRESH_BAND",
                &self.pod_certificate_refresh_band,
                e,
            )
        })?;
        Ok(Some(super::PodCertSettings {
            signer_name,
            lifetime,
            refresh_band,
            pod_wait: bounded_duration(
                "MESHCA_POD_CERTIFICATE_POD_WAIT",
                &self.pod_certificate_pod_wait,
                true,
                Duration::from_secs(3600),
            )?,
            workers: bounded(
                "MESHCA_POD_CERTIFICATE_WORKERS",
                self.pod_certificate_workers,
                1,
                1024,
            )?,
            trust_bundle: self.pod_certificate_trust_bundle,
            // The same full re-check period as the root ConfigMap publisher.
            trust_bundle_resync: publish_resync()?,
        }))
    }
}
