//! ClusterTrustBundle publisher (`certificates.k8s.io/v1`, GA in 1.37):
//! keeps one signer-linked ClusterTrustBundle holding a set of root
//! certificates, so pods can mount meshca's roots with a
//! `clusterTrustBundle` projection (by name, or by signer name).
//!
//! It takes the roots as a channel of PEM texts, not from the CA store, so
//! any set can be published: the current root (the pod certificate signer),
//! or old and new roots together during a CA rotation. What to write is the
//! pure [`trust_bundle`] and [`decide`]; [`run`] does the I/O.
//!
//! The API version is discovered: `v1` where served, else `v1beta1` (Kubernetes
//! 1.33-1.36 with the beta API enabled); the object is the same in both.
//!
//! A signer-linked bundle needs RBAC `attest` on `signers/<signer name>`
//! beside the ClusterTrustBundle verbs, and its name must start with the
//! signer name with '/' as ':' followed by ':' ([`trust_bundle_name`]).

use std::time::Duration;

use k8s_openapi::api::certificates::v1::ClusterTrustBundleSpec;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::{Api, Client};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use tokio::sync::watch;
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::flags::{err, ConfigError};

/// The API's cap on `spec.trustBundle`.
pub const MAX_TRUST_BUNDLE_BYTES: usize = 1024 * 1024;
/// Label on the bundles meshca manages.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "meshca");
/// Istio's signer for its root ClusterTrustBundle (`ENABLE_CLUSTER_TRUST_BUNDLE_API`);
/// its bundle is `istio.io:istiod-ca:root-cert`.
pub const ISTIO_SIGNER: &str = "istio.io/istiod-ca";
/// The API's cap on an object name.
const MAX_NAME_BYTES: usize = 253;
const GROUP: &str = "certificates.k8s.io";
const PLURAL: &str = "clustertrustbundles";
/// Versions tried, newest first.
pub const VERSIONS: [&str; 2] = ["v1", "v1beta1"];
/// How soon a failed write is tried again.
const RETRY_EVERY: Duration = Duration::from_secs(5);

/// Which bundle to keep and how often to re-check it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CtbSettings {
    pub name: String,
    pub signer_name: String,
    pub resync: Duration,
}

/// Why a set of roots cannot be published; each has a reason code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CtbError {
    #[error("no root certificate to publish")]
    Empty,
    #[error("root {0} does not parse as an X.509 certificate")]
    Unparsable(usize),
    #[error("root {0} is not a CA certificate (the API refuses it)")]
    NotCa(usize),
    #[error("the trust bundle is {0} bytes, over the API's {MAX_TRUST_BUNDLE_BYTES}")]
    TooLarge(usize),
}

impl CtbError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Empty => "ctb_empty",
            Self::Unparsable(_) => "ctb_unparsable_root",
            Self::NotCa(_) => "ctb_not_ca",
            Self::TooLarge(_) => "ctb_too_large",
        }
    }
}

/// The `spec.trustBundle` text for `roots` (PEM texts, each one or more
/// certificates): every certificate once, in order of first appearance,
/// re-encoded without PEM headers, as the API's validation wants.
pub fn trust_bundle(roots: &[String]) -> Result<String, CtbError> {
    let mut seen: Vec<CertificateDer<'static>> = Vec::new();
    for text in roots {
        for der in CertificateDer::pem_slice_iter(text.as_bytes()) {
            let der = der.map_err(|_| CtbError::Unparsable(seen.len()))?;
            if !seen.contains(&der) {
                seen.push(der);
            }
        }
    }
    if seen.is_empty() {
        return Err(CtbError::Empty);
    }
    let mut out = String::new();
    for (i, der) in seen.iter().enumerate() {
        let (_, cert) = X509Certificate::from_der(der).map_err(|_| CtbError::Unparsable(i))?;
        let ca = cert
            .basic_constraints()
            .ok()
            .flatten()
            .is_some_and(|bc| bc.value.ca);
        if !ca {
            return Err(CtbError::NotCa(i));
        }
        out.push_str(&crate::primitives::pem_encode("CERTIFICATE", der));
    }
    if out.len() > MAX_TRUST_BUNDLE_BYTES {
        return Err(CtbError::TooLarge(out.len()));
    }
    Ok(out)
}

/// Checks a bundle name for `signer_name` as the API does for signer-linked
/// bundles: `<signer with / as :>:` then a non-empty rest, one path segment.
pub fn check_name(name: &str, signer_name: &str) -> Result<(), &'static str> {
    let prefix = format!("{}:", signer_name.replace('/', ":"));
    let rest = name.strip_prefix(&prefix).ok_or(
        "a signer-linked bundle's name must start with the signer name ('/' as ':') and ':'",
    )?;
    if rest.is_empty() || name.len() > MAX_NAME_BYTES || name.contains('/') || name.contains('%') {
        return Err("the name needs a suffix after the signer, no '/' or '%', at most 253 bytes");
    }
    Ok(())
}

/// Whether the pod-certificate signer still writes its own bundle (named
/// `signer_bundle`) when the standalone publisher runs: not when both
/// would write the same object, which would flip between their root sets
/// during a rotation. The standalone one wins, as it carries every root.
pub fn signer_publishes(
    signer_wants: bool,
    signer_bundle: &str,
    standalone: Option<&CtbSettings>,
) -> bool {
    signer_wants && standalone.is_none_or(|s| s.name != signer_bundle)
}

/// The standalone publisher's input: each trust set's roots, one PEM per
/// root (old and new during a rotation).
pub fn follow_trust(
    mut trust: watch::Receiver<crate::rotation::trust::TrustSet>,
) -> (watch::Receiver<Vec<String>>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = watch::channel(trust.borrow().roots_pem.clone());
    let task = tokio::spawn(async move {
        while trust.changed().await.is_ok() {
            let roots = trust.borrow().roots_pem.clone();
            tx.send_if_modified(|cur| {
                let changed = *cur != roots;
                if changed {
                    *cur = roots;
                }
                changed
            });
        }
    });
    (rx, task)
}

/// What to do about the bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Create,
    /// Replace the spec (signer name or bundle differ).
    Update,
    Nothing,
}

/// Compares what exists (`signerName`, `trustBundle`) with what is wanted.
pub fn decide(current: Option<(Option<&str>, &str)>, signer_name: &str, bundle: &str) -> Action {
    match current {
        None => Action::Create,
        Some((s, b)) if s == Some(signer_name) && b == bundle => Action::Nothing,
        Some(_) => Action::Update,
    }
}

/// The ClusterTrustBundle resource of `version`.
pub fn resource(version: &str) -> ApiResource {
    let gvk = GroupVersionKind::gvk(GROUP, version, "ClusterTrustBundle");
    ApiResource::from_gvk_with_plural(&gvk, PLURAL)
}

/// The served ClusterTrustBundle version, newest first; `None` when the API
/// server serves none (before 1.37 without the beta API turned on).
pub async fn discover(client: &Client) -> Result<Option<ApiResource>, kube::Error> {
    crate::primitives::served_resource(client, GROUP, &VERSIONS, "ClusterTrustBundle", PLURAL).await
}

/// The spec of a fetched bundle (`None` if it does not read as one, which
/// makes [`decide`] replace it).
fn spec_of(obj: &DynamicObject) -> Option<ClusterTrustBundleSpec> {
    serde_json::from_value(obj.data.get("spec")?.clone()).ok()
}

/// Makes the bundle named in `settings` hold `bundle`; returns what it did.
pub async fn apply(
    api: &Api<DynamicObject>,
    ar: &ApiResource,
    settings: &CtbSettings,
    bundle: &str,
) -> Result<Action, kube::Error> {
    let current = api.get_opt(&settings.name).await?;
    let spec_now = current.as_ref().map(spec_of);
    let action = decide(
        spec_now.as_ref().map(|s| match s {
            Some(s) => (s.signer_name.as_deref(), s.trust_bundle.as_str()),
            None => (None, ""),
        }),
        &settings.signer_name,
        bundle,
    );
    let spec = serde_json::json!({
        "signerName": settings.signer_name,
        "trustBundle": bundle,
    });
    match (&action, current) {
        (Action::Create, _) => {
            let mut obj =
                DynamicObject::new(&settings.name, ar).data(serde_json::json!({ "spec": spec }));
            obj.metadata.labels = Some([(MANAGED_BY.0.into(), MANAGED_BY.1.into())].into());
            api.create(&PostParams::default(), &obj).await?;
        }
        (Action::Update, Some(mut obj)) => {
            // resourceVersion is kept: a concurrent writer makes this a 409, retried.
            obj.data["spec"] = spec;
            api.replace(&settings.name, &PostParams::default(), &obj)
                .await?;
        }
        _ => {}
    }
    Ok(action)
}

/// The CA store's root bundle as a roots channel, updated on every CA swap
/// (one root set; a rotation feeds its own channel with old and new).
pub fn follow_ca(
    ca: std::sync::Arc<crate::ca::CaStore>,
) -> (watch::Receiver<Vec<String>>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = watch::channel(vec![ca.snapshot().root_bundle().to_string()]);
    let mut generation = ca.subscribe();
    let task = tokio::spawn(async move {
        while generation.changed().await.is_ok() {
            let root = vec![ca.snapshot().root_bundle().to_string()];
            tx.send_if_modified(|cur| {
                let changed = *cur != root;
                if changed {
                    *cur = root;
                }
                changed
            });
        }
    });
    (rx, task)
}

/// Keeps the bundle current: on every change of `roots` and every resync.
pub async fn run(client: Client, settings: CtbSettings, mut roots: watch::Receiver<Vec<String>>) {
    let ar = loop {
        match discover(&client).await {
            Ok(Some(ar)) => break ar,
            Ok(None) => tracing::error!(
                name = %settings.name,
                "the API server serves no {GROUP} ClusterTrustBundle (v1 or v1beta1): not published; retrying"
            ),
            Err(e) => tracing::warn!(error = %e, "ClusterTrustBundle discovery failed; retrying"),
        }
        tokio::time::sleep(RETRY_EVERY).await;
    };
    tracing::info!(version = %ar.version, name = %settings.name, "publishing the ClusterTrustBundle");
    let api: Api<DynamicObject> = Api::all_with(client, &ar);
    loop {
        let wanted = trust_bundle(&roots.borrow_and_update());
        let wait = match wanted {
            Err(e) => {
                tracing::error!(error = %e, reason = e.reason(), name = %settings.name, "ClusterTrustBundle not published");
                settings.resync
            }
            Ok(bundle) => match apply(&api, &ar, &settings, &bundle).await {
                Ok(Action::Nothing) => settings.resync,
                Ok(action) => {
                    tracing::info!(name = %settings.name, ?action, "ClusterTrustBundle published");
                    settings.resync
                }
                Err(e) => {
                    tracing::warn!(error = %e, name = %settings.name, "ClusterTrustBundle write failed; retrying");
                    RETRY_EVERY
                }
            },
        };
        tokio::select! {
            changed = roots.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// Flags of the standalone ClusterTrustBundle publisher (`ctb`): the mesh
/// roots, old and new during a rotation, next to the root ConfigMap.
#[derive(Debug, Clone, clap::Args)]
pub struct CtbArgs {
    /// Publish the root bundle (every root, old and new during a rotation)
    /// as a signer-linked ClusterTrustBundle (certificates.k8s.io/v1).
    ///
    /// `certificates.k8s.io/v1`, else `v1beta1` where only that is served; next to the root
    /// ConfigMap. Needs Kubernetes and `attest` on the signer. Re-checked every
    /// MESHCA_PUBLISH_ROOT_RESYNC.
    #[arg(long, env = "MESHCA_PUBLISH_CLUSTER_TRUST_BUNDLE", default_value_t = false, action = clap::ArgAction::Set)]
    pub publish_cluster_trust_bundle: bool,
    /// Signer name the bundle is linked to (Istio's by default, so Istio's
    /// injection templates that mount it by signer or name find it).
    #[arg(
        long,
        env = "MESHCA_CLUSTER_TRUST_BUNDLE_SIGNER",
        default_value = ISTIO_SIGNER
    )]
    pub cluster_trust_bundle_signer: String,
    /// Bundle name; empty: `<signer with / as :>:root-cert`
    /// (`istio.io:istiod-ca:root-cert` for Istio's signer).
    ///
    /// It must start with the signer name (`/` as `:`) and `:`. If the pod-certificate signer's
    /// bundle has the same name, only this publisher writes it.
    #[arg(long, env = "MESHCA_CLUSTER_TRUST_BUNDLE_NAME", default_value = "")]
    pub cluster_trust_bundle_name: String,
}

impl CtbArgs {
    pub fn parse(
        &self,
        kube_on: bool,
        publish_resync: impl FnOnce() -> Result<Duration, ConfigError>,
    ) -> Result<Option<CtbSettings>, ConfigError> {
        if !self.publish_cluster_trust_bundle {
            return Ok(None);
        }
        if !kube_on {
            return Err(err(
                "MESHCA_PUBLISH_CLUSTER_TRUST_BUNDLE",
                "true",
                "needs Kubernetes (a kubeconfig or in-cluster config)",
            ));
        }
        let signer = self.cluster_trust_bundle_signer.trim();
        let signer_name = parse_signer_name(signer)
            .map_err(|e| err("MESHCA_CLUSTER_TRUST_BUNDLE_SIGNER", signer, e.detail))?;
        let name = match self.cluster_trust_bundle_name.trim() {
            "" => trust_bundle_name(&signer_name),
            n => n.to_string(),
        };
        check_name(&name, &signer_name)
            .map_err(|e| err("MESHCA_CLUSTER_TRUST_BUNDLE_NAME", &name, e))?;
        Ok(Some(CtbSettings {
            name,
            signer_name,
            // The same full re-check period as the root ConfigMap publisher.
            resync: publish_resync()?,
        }))
    }
}

/// Suffix of the signer-linked ClusterTrustBundle name.
pub const TRUST_BUNDLE_SUFFIX: &str = "root-cert";

/// Why a signer name is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("signer name {name:?}: {detail}")]
pub struct SignerNameError {
    pub name: String,
    pub detail: &'static str,
}

/// Checks a signer name the way the API does for custom signers
/// (`<domain>/<path>`), and refuses the reserved `kubernetes.io` domain.
pub fn parse_signer_name(s: &str) -> Result<String, SignerNameError> {
    let e = |detail| SignerNameError {
        name: s.to_string(),
        detail,
    };
    let (domain, path) = s
        .split_once('/')
        .ok_or_else(|| e("must be <domain>/<path>"))?;
    if domain.is_empty() || domain.len() > 253 || path.is_empty() || s.len() > 571 {
        return Err(e(
            "domain and path must be non-empty (domain at most 253 bytes)",
        ));
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if !domain.split('.').all(label_ok) || !domain.contains('.') {
        return Err(e("domain must be a fully qualified DNS name"));
    }
    if domain == "kubernetes.io" || domain.ends_with(".kubernetes.io") || domain == "k8s.io" {
        return Err(e("the kubernetes.io and k8s.io domains are reserved"));
    }
    if !path
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/'))
        || path
            .split('/')
            .any(|seg| seg.is_empty() || seg == "." || seg == "..")
    {
        return Err(e(
            "path segments may hold letters, digits, '-', '_' and '.'",
        ));
    }
    Ok(s.to_string())
}

/// The ClusterTrustBundle name for a signer: the API requires the signer
/// name with '/' as ':' and a ':' before the rest.
pub fn trust_bundle_name(signer_name: &str) -> String {
    format!("{}:{TRUST_BUNDLE_SUFFIX}", signer_name.replace('/', ":"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::generate::KeyType;
    use crate::testing::TestPki;

    #[test]
    fn bundles_dedupe_and_keep_order() {
        let a = TestPki::new(KeyType::EcdsaP256);
        let b = TestPki::new(KeyType::EcdsaP256);
        let ra = a.ca.root_cert.clone();
        let rb = b.ca.root_cert.clone();
        let one = trust_bundle(std::slice::from_ref(&ra)).unwrap();
        let both = trust_bundle(&[ra.clone(), format!("{rb}{ra}")]).unwrap();
        assert_eq!(one.matches("BEGIN CERTIFICATE").count(), 1);
        assert_eq!(both.matches("BEGIN CERTIFICATE").count(), 2);
        assert!(both.starts_with(&one), "old root first, as given");
    }

    #[test]
    fn only_ca_certificates_are_published() {
        let a = TestPki::new(KeyType::EcdsaP256);
        assert_eq!(trust_bundle(&[]).unwrap_err(), CtbError::Empty);
        assert_eq!(
            trust_bundle(&["nothing".into()]).unwrap_err(),
            CtbError::Empty
        );
        let bundle =
            crate::ca::CaBundle::load_dir(a.path(), time::OffsetDateTime::now_utc()).unwrap();
        let id = "spiffe://cluster.local/ns/a/sa/b".parse().unwrap();
        let (leaf, _) = bundle
            .client_identity(&id, &crate::testing::validity_hours(-1, 1))
            .unwrap();
        let leaf_only = leaf
            .split("-----END CERTIFICATE-----")
            .next()
            .unwrap()
            .to_string()
            + "-----END CERTIFICATE-----\n";
        assert_eq!(
            trust_bundle(&[leaf_only]).unwrap_err().reason(),
            "ctb_not_ca"
        );
    }

    #[test]
    fn istio_layout_and_name_checks() {
        let istio = trust_bundle_name(ISTIO_SIGNER);
        assert_eq!(istio, "istio.io:istiod-ca:root-cert");
        let table: &[(&str, &str, bool)] = &[
            ("istio.io:istiod-ca:root-cert", ISTIO_SIGNER, true),
            ("istio.io:istiod-ca:other", ISTIO_SIGNER, true),
            ("istio.io:istiod-ca:", ISTIO_SIGNER, false),
            ("istio.io:istiod-ca", ISTIO_SIGNER, false),
            ("root-cert", ISTIO_SIGNER, false),
            ("istio.io:istiod:root-cert", ISTIO_SIGNER, false),
            ("m.io:a:b:root-cert", "m.io/a/b", true),
            ("m.io:a:b:x%2f", "m.io/a/b", false),
        ];
        for (name, signer, ok) in table {
            assert_eq!(check_name(name, signer).is_ok(), *ok, "{name} for {signer}");
        }
        let long = format!("istio.io:istiod-ca:{}", "x".repeat(240));
        assert!(check_name(&long, ISTIO_SIGNER).is_err());
    }

    #[test]
    fn one_writer_per_bundle() {
        let s = |name: &str| CtbSettings {
            name: name.into(),
            signer_name: ISTIO_SIGNER.into(),
            resync: Duration::from_secs(60),
        };
        let same = s("m.io:s:root-cert");
        let other = s("istio.io:istiod-ca:root-cert");
        // (signer wants it, standalone) -> signer still writes
        assert!(signer_publishes(true, "m.io:s:root-cert", None));
        assert!(!signer_publishes(false, "m.io:s:root-cert", None));
        assert!(signer_publishes(true, "m.io:s:root-cert", Some(&other)));
        assert!(!signer_publishes(true, "m.io:s:root-cert", Some(&same)));
        assert!(!signer_publishes(false, "m.io:s:root-cert", Some(&other)));
    }

    #[test]
    fn both_versions_address_the_same_object() {
        for v in VERSIONS {
            let ar = resource(v);
            assert_eq!(ar.api_version, format!("certificates.k8s.io/{v}"));
            assert_eq!(
                (ar.kind.as_str(), ar.plural.as_str()),
                ("ClusterTrustBundle", PLURAL)
            );
        }
        let obj: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "certificates.k8s.io/v1beta1", "kind": "ClusterTrustBundle",
            "metadata": {"name": "m.io:s:root-cert"},
            "spec": {"signerName": "m.io/s", "trustBundle": "B"}
        }))
        .unwrap();
        let spec = spec_of(&obj).unwrap();
        assert_eq!(
            (spec.signer_name.as_deref(), spec.trust_bundle.as_str()),
            (Some("m.io/s"), "B")
        );
        let mut broken = obj.clone();
        broken.data["spec"] = serde_json::json!({"trustBundle": 7});
        assert!(spec_of(&broken).is_none(), "an unreadable spec is replaced");
    }

    #[test]
    fn decisions() {
        assert_eq!(decide(None, "m.io/s", "B"), Action::Create);
        assert_eq!(
            decide(Some((Some("m.io/s"), "B")), "m.io/s", "B"),
            Action::Nothing
        );
        assert_eq!(
            decide(Some((Some("m.io/s"), "A")), "m.io/s", "B"),
            Action::Update
        );
        assert_eq!(decide(Some((None, "B")), "m.io/s", "B"), Action::Update);
    }
}
