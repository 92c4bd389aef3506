//! Watches the PodCertificateRequests of meshca's signer name (a field
//! selector: no other signer's requests are read) and writes each one's
//! terminal status: `Issued` with the chain, or `Denied` / `Failed`.
//!
//! Per request: [`super::decide::decide`] over the request and the pod
//! index; an issued leaf comes from the same CA snapshot and leaf profile as
//! CreateCertificate ([`crate::ca::CaBundle::sign_leaf`]); the audit record
//! is acknowledged before the status carries the certificate, as on the
//! gRPC path. One replica decides each request: it claims the request first
//! ([`super::claim`]), and both the claim and the status write are a PUT
//! with the object's resourceVersion, so a replica that loses a race signs
//! nothing and records nothing.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Client;
use serde::Deserialize;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

pub use super::metrics::{ClaimLabels, ConditionLabels, PodCertMetrics, WriteLabels};

use super::claim;
use super::decide::{self, Decision, FailReason, IndexView, PcrFacts, PodFacts, Policy};
use super::PodCertSettings;
use crate::audit::{AuditGuard, AuditSink};
use crate::ca::{CaBundle, CaStore, Validity};
use crate::denylist::{Denylist, LiveDenylist};
use crate::identity::TrustDomain;
use crate::podindex::PodIndex;
use crate::primitives::lock;

/// API group of PodCertificateRequest.
pub const GROUP: &str = "certificates.k8s.io";
/// Versions tried, newest first: GA `v1` (1.37+), then `v1beta1` (1.35, 1.36).
pub const VERSIONS: [&str; 2] = ["v1", "v1beta1"];
const PLURAL: &str = "podcertificaterequests";
/// How often a request waiting for the pod index is looked at again.
const WAIT_STEP: Duration = Duration::from_millis(250);
/// Attempts of one status write that fails for a transient reason.
const WRITE_ATTEMPTS: u32 = 6;

/// The spec fields meshca reads (v1 and v1beta1 share the names; v1 has no
/// `pkixPublicKey`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecWire {
    #[serde(default)]
    pub signer_name: String,
    #[serde(default)]
    pub pod_name: String,
    #[serde(default, rename = "podUID")]
    pub pod_uid: String,
    #[serde(default)]
    pub service_account_name: String,
    #[serde(default)]
    pub node_name: String,
    #[serde(default)]
    pub max_expiration_seconds: Option<i64>,
    #[serde(default)]
    pub pkix_public_key: Option<k8s_openapi::ByteString>,
    #[serde(default, rename = "stubPKCS10Request")]
    pub stub_pkcs10_request: Option<k8s_openapi::ByteString>,
    #[serde(default)]
    pub unverified_user_annotations: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct StatusWire {
    #[serde(default)]
    conditions: Vec<ConditionWire>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct ConditionWire {
    #[serde(default, rename = "type")]
    type_: String,
}

/// Whether a request already carries a terminal condition.
pub fn is_terminal(obj: &DynamicObject) -> bool {
    obj.data
        .get("status")
        .and_then(|s| serde_json::from_value::<StatusWire>(s.clone()).ok())
        .is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| matches!(c.type_.as_str(), "Issued" | "Denied" | "Failed"))
        })
}

/// Labels of the decision counter.
/// Everything the signer shares with the gRPC path.
#[derive(Debug)]
pub struct Signer {
    pub settings: PodCertSettings,
    pub trust_domain: TrustDomain,
    pub ca: Arc<CaStore>,
    pub index: Arc<PodIndex>,
    pub max_index_staleness: Duration,
    pub denylist: Option<Arc<LiveDenylist>>,
    pub audit: Arc<dyn AuditSink>,
    pub metrics: Arc<PodCertMetrics>,
}

/// The served PodCertificateRequest version, newest first; `None` when the
/// API server serves none (the feature is off before 1.37).
pub async fn discover(client: &Client) -> Result<Option<ApiResource>, kube::Error> {
    crate::primitives::served_resource(client, GROUP, &VERSIONS, "PodCertificateRequest", PLURAL)
        .await
}

/// Starts the signer and, when configured, its ClusterTrustBundle
/// publisher fed from the CA store's root bundle.
pub fn spawn(client: Client, signer: Signer) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    if signer.settings.trust_bundle {
        let (roots, follow) = crate::ctb::follow_ca(signer.ca.clone());
        tasks.push(follow);
        let settings = crate::ctb::CtbSettings {
            name: super::trust_bundle_name(&signer.settings.signer_name),
            signer_name: signer.settings.signer_name.clone(),
            resync: signer.settings.trust_bundle_resync,
        };
        tasks.push(tokio::spawn(crate::ctb::run(
            client.clone(),
            settings,
            roots,
        )));
    }
    tasks.push(tokio::spawn(run(client, Arc::new(signer))));
    tasks
}

/// Runs the signer until the task is aborted.
pub async fn run(client: Client, signer: Arc<Signer>) {
    let ar = loop {
        match discover(&client).await {
            Ok(Some(ar)) => break ar,
            Ok(None) => tracing::error!(
                "the API server serves no {GROUP} PodCertificateRequest (v1 or v1beta1): pod certificates cannot be signed; retrying"
            ),
            Err(e) => tracing::warn!(error = %e, "PodCertificateRequest discovery failed; retrying"),
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
    };
    tracing::info!(version = %ar.version, signer = %signer.settings.signer_name, "signing PodCertificateRequests");
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    let config = watcher::Config::default()
        .fields(&format!("spec.signerName={}", signer.settings.signer_name));
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    let claimed: Arc<Mutex<HashSet<String>>> = Arc::default();
    let permits = Arc::new(tokio::sync::Semaphore::new(signer.settings.workers.max(1)));
    let holder: Arc<str> = claim::holder().into();
    tracing::info!(holder = %holder, "PodCertificateRequest claim holder");
    while let Some(event) = stream.next().await {
        let obj = match event {
            Ok(Event::Apply(o) | Event::InitApply(o)) => o,
            Ok(Event::Delete(o)) => {
                if let Some(uid) = &o.metadata.uid {
                    lock(&claimed).remove(uid);
                }
                continue;
            }
            Ok(Event::Init | Event::InitDone) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "PodCertificateRequest watch error; retrying with backoff");
                continue;
            }
        };
        let Some(uid) = obj.metadata.uid.clone() else {
            continue;
        };
        if is_terminal(&obj) {
            // Decided (by us or another replica): nothing left to guard.
            lock(&claimed).remove(&uid);
            continue;
        }
        if !lock(&claimed).insert(uid.clone()) {
            continue; // in flight
        }
        let (signer, client, ar, permits, claimed, holder) = (
            signer.clone(),
            client.clone(),
            ar.clone(),
            permits.clone(),
            claimed.clone(),
            holder.clone(),
        );
        tokio::spawn(async move {
            let mut obj = obj;
            loop {
                match handle(&signer, &client, &ar, obj, &permits, &holder).await {
                    Handled::Done => break,
                    Handled::NotYet => {
                        // Not decided: a later event (or relist) tries again.
                        lock(&claimed).remove(&uid);
                        break;
                    }
                    Handled::HeldElsewhere {
                        namespace,
                        name,
                        wait,
                    } => {
                        // Another replica decides. Its status write ends
                        // this (an event); if it died, its claim lapses and
                        // this replica looks again.
                        tokio::time::sleep(wait + Duration::from_millis(250)).await;
                        let api: Api<DynamicObject> =
                            Api::namespaced_with(client.clone(), &namespace, &ar);
                        match api.get(&name).await {
                            Ok(fresh) if !is_terminal(&fresh) => obj = fresh,
                            Ok(_) => break,
                            Err(_) => {
                                lock(&claimed).remove(&uid);
                                break;
                            }
                        }
                    }
                }
            }
        });
    }
}

/// The decision's facts from one object.
pub fn facts(obj: &DynamicObject, now: OffsetDateTime) -> Result<PcrFacts, String> {
    let spec: SpecWire = obj
        .data
        .get("spec")
        .cloned()
        .map(serde_json::from_value)
        .ok_or("no spec")?
        .map_err(|e| format!("spec: {e}"))?;
    let created = obj
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
        .and_then(|s| OffsetDateTime::from_unix_timestamp(s).ok())
        .unwrap_or(now);
    let age = (now - created).max(time::Duration::ZERO);
    Ok(PcrFacts {
        namespace: obj.metadata.namespace.clone().unwrap_or_default(),
        name: obj.metadata.name.clone().unwrap_or_default(),
        uid: obj.metadata.uid.clone().unwrap_or_default(),
        key: super::key::public_key(
            spec.stub_pkcs10_request.as_ref().map(|b| b.0.as_slice()),
            spec.pkix_public_key.as_ref().map(|b| b.0.as_slice()),
        ),
        pod_name: spec.pod_name,
        pod_uid: spec.pod_uid,
        service_account: spec.service_account_name,
        node_name: spec.node_name,
        max_expiration_seconds: spec.max_expiration_seconds,
        unverified_user_annotations: spec.unverified_user_annotations,
        age: age.try_into().unwrap_or_default(),
    })
}

/// What the pod index says about `namespace/pod` now.
pub fn index_view(
    index: &PodIndex,
    max_staleness: Duration,
    namespace: &str,
    pod: &str,
) -> IndexView {
    if !index.is_synced() {
        return IndexView::NotSynced;
    }
    if let Some(d) = index.disconnected_for().filter(|d| *d > max_staleness) {
        return IndexView::Stale(d);
    }
    let now = OffsetDateTime::now_utc().unix_timestamp();
    IndexView::Synced(index.read(|s| {
        s.get(namespace, pod).map(|p| PodFacts {
            uid: p.uid.to_string(),
            node: p.node.map(str::to_string),
            service_account: p.service_account.to_string(),
            phase: p.phase,
            deleted: p.deleted_by(now),
        })
    }))
}

/// The status a decision writes.
enum Outcome {
    Issued {
        chain: String,
        times: decide::Times,
        message: String,
    },
    Denied(decide::DenyReason),
    Failed(FailReason),
}

/// What became of one look at a request.
enum Handled {
    /// Decided, by us or found decided by someone else, or gone.
    Done,
    /// Not decided; a later event tries again.
    NotYet,
    /// Another replica holds the claim for `wait` more.
    HeldElsewhere {
        namespace: String,
        name: String,
        wait: Duration,
    },
}

/// Decides one request and writes its status, if this replica wins the
/// claim on it.
async fn handle(
    signer: &Signer,
    client: &Client,
    ar: &ApiResource,
    mut obj: DynamicObject,
    permits: &tokio::sync::Semaphore,
    holder: &str,
) -> Handled {
    let seen = Instant::now();
    let policy = Policy {
        trust_domain: signer.trust_domain.clone(),
        lifetime: signer.settings.lifetime,
        refresh_band: signer.settings.refresh_band,
        pod_wait: signer.settings.pod_wait,
    };
    let (facts, decision) = loop {
        let facts = match facts(&obj, OffsetDateTime::now_utc()) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(error = %e, name = ?obj.metadata.name, "unreadable PodCertificateRequest");
                return Handled::NotYet;
            }
        };
        let view = index_view(
            &signer.index,
            signer.max_index_staleness,
            &facts.namespace,
            &facts.pod_name,
        );
        let denylist = signer
            .denylist
            .as_ref()
            .map(|d| d.current())
            .unwrap_or_else(|| Arc::new(Denylist::default()));
        match decide::decide(&facts, &view, &denylist, &policy) {
            Decision::Wait(_) => tokio::time::sleep(WAIT_STEP).await,
            d => break (facts, d),
        }
    };
    let Ok(_permit) = permits.acquire().await else {
        return Handled::NotYet;
    };
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &facts.namespace, ar);
    let claimed = take_claim(&api, &mut obj, holder).await;
    signer
        .metrics
        .claims
        .get_or_create(&ClaimLabels {
            result: claimed.label(),
        })
        .inc();
    match claimed {
        Claimed::Ours => {}
        Claimed::Decided | Claimed::Gone => return Handled::Done,
        Claimed::HeldElsewhere(wait) => {
            return Handled::HeldElsewhere {
                namespace: facts.namespace,
                name: facts.name,
                wait,
            }
        }
        Claimed::Forbidden => {
            tracing::error!(signer = %signer.settings.signer_name, "claiming a PodCertificateRequest forbidden: meshca needs `update` on podcertificaterequests");
            return Handled::NotYet;
        }
        Claimed::Failed => return Handled::NotYet,
    }
    let mut audit = AuditGuard::new(signer.audit.clone(), None, None);
    {
        let r = audit.record();
        r.authn_method = Some(super::AUTHN_METHOD.into());
        r.node = Some(facts.node_name.clone());
        r.caller_pod = Some(format!("{}/{}", facts.namespace, facts.pod_name));
        r.caller_pod_uid = Some(facts.pod_uid.clone());
        r.pod_certificate_request = Some(format!("{}/{}", facts.namespace, facts.name));
        r.pod_certificate_request_uid = Some(facts.uid.clone());
    }
    let outcome = match decision {
        Decision::Issue {
            identity,
            spki_der,
            lifetime,
        } => {
            audit.record().requested_identity = Some(identity.to_string());
            let bundle = signer.ca.snapshot();
            match sign_recorded(
                &signer.ca,
                &bundle,
                &spki_der,
                &identity,
                lifetime,
                &signer.settings,
            ) {
                Ok((leaf, chain, times)) => {
                    let r = audit.record();
                    r.serial = Some(leaf.serial_hex.clone());
                    r.spki_sha256 = Some(hex::encode(crate::primitives::sha256(&spki_der)));
                    r.not_before = Some(times.not_before);
                    r.not_after = Some(times.not_after);
                    r.issuer_key_id = Some(bundle.key_id().to_string());
                    audit.allow();
                    Outcome::Issued {
                        chain,
                        times,
                        message: format!("issued {identity} serial {}", leaf.serial_hex),
                    }
                }
                Err(f) => {
                    audit.deny(f.reason(), None, f.to_string());
                    Outcome::Failed(f)
                }
            }
        }
        Decision::Deny(d) => {
            if let Ok(id) = crate::identity::SpiffeId::new(
                signer.trust_domain.clone(),
                &facts.namespace,
                &facts.service_account,
            ) {
                audit.record().requested_identity = Some(id.to_string());
            }
            audit.deny(d.reason(), None, d.to_string());
            Outcome::Denied(d)
        }
        Decision::Fail(f) => {
            audit.deny(f.reason(), None, f.to_string());
            Outcome::Failed(f)
        }
        Decision::Wait(_) => return Handled::NotYet,
    };
    let (condition, reason) = match &outcome {
        Outcome::Issued { .. } => ("Issued", "issued"),
        Outcome::Denied(d) => ("Denied", d.reason()),
        Outcome::Failed(f) => ("Failed", f.reason()),
    };
    let request_id = audit.request_id().to_string();
    // No certificate is handed out without its acknowledged record.
    if let Err(e) = audit.finish_acked().await {
        tracing::error!(error = %e, pcr = %format!("{}/{}", facts.namespace, facts.name), "audit record not written: PodCertificateRequest left undecided");
        return Handled::NotYet;
    }
    signer
        .metrics
        .decisions
        .get_or_create(&ConditionLabels {
            condition,
            reason: reason.into(),
        })
        .inc();
    let status = status_json(&outcome, OffsetDateTime::now_utc());
    let mut attempt = 0;
    let result = loop {
        attempt += 1;
        obj.data["status"] = status.clone();
        match api
            .replace_status(&facts.name, &PostParams::default(), &obj)
            .await
        {
            Ok(_) => break "ok",
            Err(kube::Error::Api(e)) if e.code == 409 => match api.get(&facts.name).await {
                Ok(fresh) if is_terminal(&fresh) => break "conflict_decided",
                // Our claim lapsed and another replica took it: it decides.
                Ok(fresh) if claim_view(&fresh, holder) != claim::View::Ours => break "claim_lost",
                Ok(fresh) => obj = fresh,
                Err(kube::Error::Api(e)) if e.code == 404 => break "gone",
                Err(_) => {}
            },
            Err(kube::Error::Api(e)) if e.code == 404 => break "gone",
            Err(kube::Error::Api(e)) if e.code == 403 => {
                tracing::error!(error = %e.message, signer = %signer.settings.signer_name, "status update forbidden: meshca needs `sign` on signers/<name>");
                break "forbidden";
            }
            Err(e) if attempt < WRITE_ATTEMPTS => {
                tracing::warn!(error = %e, attempt, "PodCertificateRequest status write failed; retrying");
                tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
            }
            Err(e) => {
                tracing::error!(error = %e, "PodCertificateRequest status write failed");
                break "error";
            }
        }
    };
    signer
        .metrics
        .status_writes
        .get_or_create(&WriteLabels { result })
        .inc();
    signer
        .metrics
        .decision_seconds
        .observe(seen.elapsed().as_secs_f64());
    tracing::info!(
        pcr = %format!("{}/{}", facts.namespace, facts.name),
        condition, reason, write = result, request_id, "PodCertificateRequest decided"
    );
    if matches!(result, "ok" | "conflict_decided" | "gone" | "claim_lost") {
        Handled::Done
    } else {
        Handled::NotYet
    }
}

/// The outcome of claiming a request.
enum Claimed {
    Ours,
    Decided,
    Gone,
    HeldElsewhere(Duration),
    Forbidden,
    Failed,
}

impl Claimed {
    fn label(&self) -> &'static str {
        match self {
            Self::Ours => "ours",
            Self::Decided => "decided",
            Self::Gone => "gone",
            Self::HeldElsewhere(_) => "held_elsewhere",
            Self::Forbidden => "forbidden",
            Self::Failed => "error",
        }
    }
}

fn claim_view(obj: &DynamicObject, holder: &str) -> claim::View {
    let value = obj
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(claim::ANNOTATION))
        .map(String::as_str);
    claim::view(
        value,
        holder,
        OffsetDateTime::now_utc().unix_timestamp(),
        claim::TTL,
    )
}

/// Makes this replica the request's decider: writes the claim annotation
/// with the object's resourceVersion; on a conflict, looks again. `obj` is
/// left at the claimed version, which the status write then swaps from.
async fn take_claim(api: &Api<DynamicObject>, obj: &mut DynamicObject, holder: &str) -> Claimed {
    let Some(name) = obj.metadata.name.clone() else {
        return Claimed::Failed;
    };
    for attempt in 1..=WRITE_ATTEMPTS {
        if is_terminal(obj) {
            return Claimed::Decided;
        }
        if let claim::View::Held { remaining } = claim_view(obj, holder) {
            return Claimed::HeldElsewhere(remaining);
        }
        let now = OffsetDateTime::now_utc().unix_timestamp();
        obj.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(claim::ANNOTATION.into(), claim::value(holder, now));
        match api.replace(&name, &PostParams::default(), obj).await {
            Ok(o) => {
                *obj = o;
                return Claimed::Ours;
            }
            Err(kube::Error::Api(e)) if e.code == 409 => match api.get(&name).await {
                Ok(fresh) => *obj = fresh,
                Err(kube::Error::Api(e)) if e.code == 404 => return Claimed::Gone,
                Err(_) => tokio::time::sleep(Duration::from_millis(100 << attempt)).await,
            },
            Err(kube::Error::Api(e)) if e.code == 404 => return Claimed::Gone,
            Err(kube::Error::Api(e)) if e.code == 403 => return Claimed::Forbidden,
            Err(e) => {
                tracing::warn!(error = %e, attempt, "claiming a PodCertificateRequest failed; retrying");
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
        }
    }
    Claimed::Failed
}

/// Signs the leaf with the CreateCertificate profile; the chain is the leaf
/// then the intermediates (no root: that is the trust bundle's job).
fn sign(
    bundle: &CaBundle,
    spki_der: &[u8],
    identity: &crate::identity::SpiffeId,
    lifetime: Duration,
    settings: &PodCertSettings,
) -> Result<(crate::ca::IssuedLeaf, String, decide::Times), FailReason> {
    let times = decide::times(
        OffsetDateTime::now_utc(),
        lifetime,
        bundle.signing_not_after(),
        settings.refresh_band,
        crate::ca::ttl::random_draw(),
    )?;
    let validity = Validity {
        not_before: times.not_before,
        not_after: times.not_after,
        clamped: false,
    };
    let leaf = bundle
        .sign_leaf(spki_der, identity, false, &validity)
        .map_err(|e| FailReason::Signing(e.to_string()))?;
    let chain = leaf_and_intermediates(bundle, &leaf.pem);
    Ok((leaf, chain, times))
}

/// [`sign`], then the leaf's end made durable in the store's issuance log
/// before the certificate can leave: a rotation's retire gate must wait for
/// pod certificates too. A failed record withholds the certificate, as for
/// CreateCertificate.
fn sign_recorded(
    store: &crate::ca::CaStore,
    bundle: &CaBundle,
    spki_der: &[u8],
    identity: &crate::identity::SpiffeId,
    lifetime: Duration,
    settings: &PodCertSettings,
) -> Result<(crate::ca::IssuedLeaf, String, decide::Times), FailReason> {
    let (leaf, chain, times) = sign(bundle, spki_der, identity, lifetime, settings)?;
    store
        .record_issued(times.not_after)
        .map_err(|e| FailReason::IssuanceRecord(e.to_string()))?;
    Ok((leaf, chain, times))
}

/// CreateCertificate's response chain without the root bundle, and without
/// any root a `cert-chain.pem` may repeat.
pub fn leaf_and_intermediates(bundle: &CaBundle, leaf_pem: &str) -> String {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateDer;
    let mut out = String::new();
    for part in bundle.response_chain(leaf_pem) {
        for der in CertificateDer::pem_slice_iter(part.as_bytes()).flatten() {
            if bundle.roots().iter().any(|r| r.as_ref() == der.as_ref()) {
                continue;
            }
            out.push_str(&crate::primitives::pem_encode("CERTIFICATE", der.as_ref()));
        }
    }
    out
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.replace_nanosecond(0)
        .unwrap_or(t)
        .format(&Rfc3339)
        .unwrap_or_default()
}

/// The `status` the API requires for each outcome: one condition of type
/// Issued, Denied or Failed with status True, reason and
/// lastTransitionTime; the chain and timestamps only when Issued.
fn status_json(outcome: &Outcome, now: OffsetDateTime) -> serde_json::Value {
    let condition = |type_: &str, reason: &str, message: String| {
        serde_json::json!([{
            "type": type_,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": rfc3339(now),
        }])
    };
    match outcome {
        Outcome::Issued {
            chain,
            times,
            message,
        } => serde_json::json!({
            "conditions": condition("Issued", "Issued", message.clone()),
            "certificateChain": chain,
            "notBefore": rfc3339(times.not_before),
            "notAfter": rfc3339(times.not_after),
            "beginRefreshAt": rfc3339(times.begin_refresh_at),
        }),
        Outcome::Denied(d) => serde_json::json!({
            "conditions": condition("Denied", d.condition_reason(), format!("meshca: {d}")),
        }),
        Outcome::Failed(f) => serde_json::json!({
            "conditions": condition("Failed", f.condition_reason(), format!("meshca: {f}")),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_v1_request_and_its_terminal_state() {
        let key = rcgen::KeyPair::generate().unwrap();
        let csr = rcgen::CertificateParams::default()
            .serialize_request(&key)
            .unwrap();
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD.encode(csr.der());
        let mut obj: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "certificates.k8s.io/v1", "kind": "PodCertificateRequest",
            "metadata": {"name": "p", "namespace": "app", "uid": "u1", "creationTimestamp": "2026-09-01T12:00:00Z"},
            "spec": {"signerName": "meshca.io/spiffe", "podName": "web-0", "podUID": "pu",
                     "serviceAccountName": "web", "serviceAccountUID": "su", "nodeName": "n1",
                     "nodeUID": "nu", "maxExpirationSeconds": 3600, "stubPKCS10Request": b64,
                     "unverifiedUserAnnotations": {"a.io/b": "c"}}
        }))
        .unwrap();
        let now = OffsetDateTime::from_unix_timestamp(1_788_264_010).unwrap();
        let f = facts(&obj, now).unwrap();
        assert_eq!(
            (f.namespace.as_str(), f.pod_name.as_str()),
            ("app", "web-0")
        );
        assert_eq!((f.pod_uid.as_str(), f.node_name.as_str()), ("pu", "n1"));
        assert_eq!(f.max_expiration_seconds, Some(3600));
        assert_eq!(f.age, Duration::from_secs(10));
        assert_eq!(f.unverified_user_annotations.len(), 1);
        assert!(matches!(f.key, decide::KeyFacts::Supported { .. }));
        assert!(!is_terminal(&obj));
        obj.data["status"] = serde_json::json!({"conditions": [{"type": "Denied"}]});
        assert!(is_terminal(&obj));
    }

    /// Pod certificates count for a rotation's gates: each one's end is
    /// recorded before it leaves, and a failed record withholds it.
    #[test]
    fn pod_certificates_are_recorded_in_the_issuance_log() {
        #[derive(Debug, Default)]
        struct Log(std::sync::Mutex<Vec<i64>>, bool);
        impl crate::ca::store::IssuanceLog for Log {
            fn reserve(&self, not_after: i64) -> Result<(), String> {
                if self.1 {
                    return Err("disk full".into());
                }
                self.0.lock().unwrap().push(not_after);
                Ok(())
            }
        }
        let pki = crate::testing::TestPki::new(crate::ca::generate::KeyType::EcdsaP256);
        let settings = PodCertSettings {
            signer_name: "meshca.io/spiffe".into(),
            lifetime: Duration::from_secs(3600),
            refresh_band: crate::ca::ttl::JitterBand::new(50, 75).unwrap(),
            pod_wait: Duration::from_secs(1),
            workers: 1,
            trust_bundle: false,
            trust_bundle_resync: Duration::from_secs(60),
        };
        let id = "spiffe://cluster.local/ns/a/sa/b".parse().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let spki = rcgen::PublicKeyData::subject_public_key_info(&key);
        for failing in [false, true] {
            let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
            let store = crate::ca::CaStore::new(bundle, None, false);
            let log = std::sync::Arc::new(Log(Default::default(), failing));
            store.set_issuance_log(log.clone());
            let r = sign_recorded(
                &store,
                &store.snapshot(),
                &spki,
                &id,
                Duration::from_secs(3600),
                &settings,
            );
            match r {
                Ok((_, _, times)) => {
                    assert!(!failing);
                    let marks = log.0.lock().unwrap().clone();
                    assert_eq!(marks, vec![times.not_after.unix_timestamp()]);
                }
                Err(e) => {
                    assert!(failing, "{e}");
                    assert_eq!(e.reason(), "podcert_issuance_record_failed");
                }
            }
        }
    }

    #[test]
    fn the_chain_is_the_leaf_then_intermediates_without_roots() {
        use rustls_pki_types::pem::PemObject;
        let pki = crate::testing::TestPki::new(crate::ca::generate::KeyType::EcdsaP256);
        let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
        // cert-chain.pem as Istio writes it repeats the root after the intermediate.
        assert!(pki.ca.cert_chain().contains(pki.ca.root_cert.trim()));
        let id = "spiffe://cluster.local/ns/a/sa/b".parse().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let leaf = bundle
            .sign_leaf(
                &rcgen::PublicKeyData::subject_public_key_info(&key),
                &id,
                false,
                &crate::testing::validity_hours(-1, 1),
            )
            .unwrap();
        let chain = leaf_and_intermediates(&bundle, &leaf.pem);
        let certs: Vec<_> = rustls_pki_types::CertificateDer::pem_slice_iter(chain.as_bytes())
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(certs.len(), 2);
        assert_eq!(certs[0], leaf.der);
        assert_eq!(&certs[1], bundle.signing_cert());
        assert!(certs.iter().all(|c| !bundle.roots().contains(c)));
    }

    #[test]
    fn statuses_follow_the_api_rules() {
        let now = time::macros::datetime!(2026-09-01 12:00:00.5 UTC);
        let band = crate::ca::ttl::JitterBand::new(50, 75).unwrap();
        let times = decide::times(
            now,
            Duration::from_secs(3600),
            now + Duration::from_secs(86_400 * 30),
            band,
            3,
        )
        .unwrap();
        let s = status_json(
            &Outcome::Issued {
                chain: "PEM".into(),
                times,
                message: "m".into(),
            },
            now,
        );
        assert_eq!(s["conditions"].as_array().unwrap().len(), 1);
        assert_eq!(s["conditions"][0]["status"], "True");
        assert_eq!(
            s["conditions"][0]["lastTransitionTime"],
            "2026-09-01T12:00:00Z"
        );
        assert_eq!(s["notBefore"], "2026-09-01T11:58:00Z");
        assert_eq!(s["notAfter"], "2026-09-01T12:58:00Z");
        let d = status_json(
            &Outcome::Denied(decide::DenyReason::UnsupportedKeyType("ECDSAP521".into())),
            now,
        );
        assert_eq!(d["conditions"][0]["reason"], "UnsupportedKeyType");
        assert!(d.get("certificateChain").is_none() && d.get("notBefore").is_none());
        assert_eq!(
            d.as_object().unwrap().len(),
            1,
            "a denial sets only the condition"
        );
    }
}
