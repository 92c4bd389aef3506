//! The cluster's ServiceAccount token signing keys, fetched through the API
//! server's OIDC discovery (`/.well-known/openid-configuration` and
//! `/openid/v1/jwks`, granted by `system:service-account-issuer-discovery`).
//!
//! One [`IssuerKeys`] per (cluster, issuer): it holds the last good key set,
//! refreshes it periodically and on an unknown `kid` (never more often than
//! the minimum interval), and keeps the last good set through an API server
//! outage, but verifies nothing with a set older than its maximum age
//! ([`key_set_age`]): a key the issuer removed stops verifying within that
//! bound even while fetches fail. It also remembers every key it has seen
//! (bounded, [`MAX_SEEN_KEYS`]), after the issuer drops it, so that which key
//! signed a token can still be told ([`IssuerKeys::signer_of`]): what a
//! `token-key` denylist entry needs. Parsing is a plain function over bytes
//! and is table-tested.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, KeyAlgorithm, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};

/// Why a key set could not be fetched or used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JwksError {
    #[error("OIDC discovery request failed: {0}")]
    Fetch(String),
    #[error("OIDC discovery document: {0}")]
    Discovery(String),
    #[error("JWKS document: {0}")]
    Document(String),
    #[error("JWKS holds no usable signing key")]
    NoUsableKey,
}

impl JwksError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Fetch(_) => "jwks_fetch_failed",
            Self::Discovery(_) => "jwks_discovery_invalid",
            Self::Document(_) => "jwks_document_invalid",
            Self::NoUsableKey => "jwks_no_usable_key",
        }
    }
}

/// One verification key: the only algorithm it may verify is fixed here, so
/// a token cannot choose another (`HS256` keyed with the public key, `none`).
#[derive(Clone)]
pub struct VerifyKey {
    pub alg: Algorithm,
    pub key: DecodingKey,
}

impl std::fmt::Debug for VerifyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerifyKey")
            .field("alg", &self.alg)
            .finish_non_exhaustive()
    }
}

/// A parsed key set: `kid` -> key, signing keys of asymmetric algorithms only.
#[derive(Debug, Clone, Default)]
pub struct KeySet {
    pub keys: HashMap<String, VerifyKey>,
    /// Keys in the document that were skipped, with why (logged once).
    pub skipped: Vec<String>,
}

impl KeySet {
    pub fn get(&self, kid: &str) -> Option<&VerifyKey> {
        self.keys.get(kid)
    }
    pub fn len(&self) -> usize {
        self.keys.len()
    }
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// Whether `token`'s signature verifies under `key`, with the algorithm the
/// key allows (whatever the header says): proof that the key's owner signed
/// these bytes. Claims are not looked at.
pub fn verifies(token: &str, key: &VerifyKey) -> bool {
    let Some((message, signature)) = token.rsplit_once('.') else {
        return false;
    };
    // Compact form only: header.claims.signature.
    if message.matches('.').count() != 1 || signature.is_empty() {
        return false;
    }
    jsonwebtoken::crypto::verify(signature, message.as_bytes(), &key.key, key.alg).unwrap_or(false)
}

/// The `kid` of a JWT's header, unverified; an empty one counts as none
/// (as the API server reads it).
pub fn header_kid(token: &str) -> Option<String> {
    jsonwebtoken::decode_header(token)
        .ok()?
        .kid
        .filter(|k| !k.is_empty())
}

/// The algorithm a JWK may verify: its `alg` when given (asymmetric only),
/// else the one its key type implies (Kubernetes signs RSA keys with RS256,
/// P-256 with ES256, P-384 with ES384). Symmetric keys are never accepted.
pub fn key_algorithm(
    params: &AlgorithmParameters,
    alg: Option<KeyAlgorithm>,
) -> Result<Algorithm, String> {
    let implied = match params {
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => Algorithm::ES256,
            EllipticCurve::P384 => Algorithm::ES384,
            ref c => return Err(format!("unsupported curve {c:?}")),
        },
        AlgorithmParameters::OctetKeyPair(_) => Algorithm::EdDSA,
        AlgorithmParameters::OctetKey(_) => return Err("symmetric key".into()),
        _ => return Err("unknown key type".into()),
    };
    let Some(alg) = alg else {
        return Ok(implied);
    };
    let named = match alg {
        KeyAlgorithm::RS256 => Algorithm::RS256,
        KeyAlgorithm::RS384 => Algorithm::RS384,
        KeyAlgorithm::RS512 => Algorithm::RS512,
        KeyAlgorithm::PS256 => Algorithm::PS256,
        KeyAlgorithm::PS384 => Algorithm::PS384,
        KeyAlgorithm::PS512 => Algorithm::PS512,
        KeyAlgorithm::ES256 => Algorithm::ES256,
        KeyAlgorithm::ES384 => Algorithm::ES384,
        KeyAlgorithm::EdDSA => Algorithm::EdDSA,
        other => {
            return Err(format!(
                "algorithm {other:?} is not an asymmetric signature"
            ))
        }
    };
    let family_ok = matches!(
        (params, named),
        (
            AlgorithmParameters::RSA(_),
            Algorithm::RS256
                | Algorithm::RS384
                | Algorithm::RS512
                | Algorithm::PS256
                | Algorithm::PS384
                | Algorithm::PS512
        ) | (AlgorithmParameters::OctetKeyPair(_), Algorithm::EdDSA)
    ) || (matches!(params, AlgorithmParameters::EllipticCurve(_))
        && named == implied);
    if family_ok {
        Ok(named)
    } else {
        Err(format!("algorithm {named:?} does not fit the key type"))
    }
}

/// Parses a JWKS document. Keys without a `kid`, for encryption, symmetric
/// or of an unsupported type are skipped; a set with no usable key is an error.
pub fn parse_jwks(body: &[u8]) -> Result<KeySet, JwksError> {
    let set: JwkSet =
        serde_json::from_slice(body).map_err(|e| JwksError::Document(e.to_string()))?;
    let mut out = KeySet::default();
    for jwk in &set.keys {
        let kid = jwk.common.key_id.clone().unwrap_or_default();
        let skip = |why: String| format!("kid {kid:?}: {why}");
        if kid.is_empty() {
            out.skipped.push(skip("no kid".into()));
            continue;
        }
        if matches!(jwk.common.public_key_use, Some(ref u) if *u != PublicKeyUse::Signature) {
            out.skipped.push(skip("not a signing key".into()));
            continue;
        }
        let alg = match key_algorithm(&jwk.algorithm, jwk.common.key_algorithm) {
            Ok(a) => a,
            Err(why) => {
                out.skipped.push(skip(why));
                continue;
            }
        };
        match DecodingKey::from_jwk(jwk) {
            Ok(key) => {
                out.keys.insert(kid, VerifyKey { alg, key });
            }
            Err(e) => out.skipped.push(skip(e.to_string())),
        }
    }
    if out.keys.is_empty() {
        return Err(JwksError::NoUsableKey);
    }
    Ok(out)
}

/// The issuer named by an OIDC discovery document.
pub fn parse_discovery(body: &[u8]) -> Result<String, JwksError> {
    #[derive(serde::Deserialize)]
    struct Doc {
        issuer: Option<String>,
    }
    let doc: Doc = serde_json::from_slice(body).map_err(|e| JwksError::Discovery(e.to_string()))?;
    doc.issuer
        .filter(|i| !i.is_empty())
        .ok_or_else(|| JwksError::Discovery("no issuer".into()))
}

/// Where a key set comes from (the API server in production; a fake in unit tests).
#[tonic::async_trait]
pub trait KeySource: Send + Sync + std::fmt::Debug {
    /// (issuer, JWKS body).
    async fn fetch(&self) -> Result<(String, Vec<u8>), JwksError>;
}

/// OIDC discovery through the API server client. The JWKS is read from the
/// API server's own path, not from the document's `jwks_uri` (which names
/// the issuer's public URL, often unreachable from inside the cluster).
#[derive(Clone)]
pub struct KubeKeySource(pub kube::Client);

impl std::fmt::Debug for KubeKeySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KubeKeySource")
    }
}

pub const DISCOVERY_PATH: &str = "/.well-known/openid-configuration";
pub const JWKS_PATH: &str = "/openid/v1/jwks";

impl KubeKeySource {
    async fn get(&self, path: &str) -> Result<Vec<u8>, JwksError> {
        let req = http::Request::get(path)
            .body(Vec::new())
            .map_err(|e| JwksError::Fetch(e.to_string()))?;
        self.0
            .request_text(req)
            .await
            .map(String::into_bytes)
            .map_err(|e| JwksError::Fetch(format!("GET {path}: {e}")))
    }
}

#[tonic::async_trait]
impl KeySource for KubeKeySource {
    async fn fetch(&self) -> Result<(String, Vec<u8>), JwksError> {
        let issuer = parse_discovery(&self.get(DISCOVERY_PATH).await?)?;
        Ok((issuer, self.get(JWKS_PATH).await?))
    }
}

/// Refresh pacing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefreshPolicy {
    /// Periodic refresh (picks up a rotated key before any token uses it).
    pub interval: Duration,
    /// Fewest seconds between two fetches, whatever triggers them (unknown
    /// `kid`s from a flood of forged tokens must not become a flood of fetches).
    pub min_interval: Duration,
    /// Deadline of one fetch.
    pub timeout: Duration,
    /// Oldest a key set may be and still verify a token locally: past it
    /// (every fetch since has failed) a key the issuer removed could still
    /// verify, so local verification hands the token to TokenReview or
    /// refuses it ([`key_set_age`]).
    pub max_age: Duration,
}

impl Default for RefreshPolicy {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(600),
            min_interval: Duration::from_secs(30),
            timeout: Duration::from_secs(5),
            max_age: Duration::from_secs(900),
        }
    }
}

/// Whether a key set fetched at `fetched` may still verify at `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySetAge {
    Fresh,
    /// Older than the maximum age by this much or more: it verifies nothing.
    Stale {
        age: Duration,
    },
}

/// The age decision: a set is stale once `now - fetched` exceeds `max_age`.
/// A clock that went backwards counts as age zero (a monotonic clock does
/// not, but the decision must not panic or grow stale from it).
pub fn key_set_age(fetched: Instant, now: Instant, max_age: Duration) -> KeySetAge {
    let age = now.saturating_duration_since(fetched);
    if age > max_age {
        KeySetAge::Stale { age }
    } else {
        KeySetAge::Fresh
    }
}

/// Most keys one issuer's [`IssuerKeys`] remembers, the current ones
/// included: past it the keys the issuer dropped longest ago are
/// forgotten. Kubernetes rotates its signing keys rarely; a forgotten key's
/// tokens are refused anyway while a `token-key` entry exists (their signer
/// can no longer be established), only their refusal names no key.
pub const MAX_SEEN_KEYS: usize = 64;

/// A key seen in a fetched set.
#[derive(Debug, Clone)]
pub struct SeenKey {
    pub key: VerifyKey,
    /// When a fetched set last held it.
    pub last_seen: Instant,
}

/// The keys remembered after a fetch: `seen` with `fresh`'s keys added or
/// renewed at `now`, and, past `max`, the keys seen longest ago dropped
/// (never one of `fresh`'s).
pub fn remember(
    seen: &HashMap<String, SeenKey>,
    fresh: &KeySet,
    now: Instant,
    max: usize,
) -> HashMap<String, SeenKey> {
    let mut out = seen.clone();
    for (kid, key) in &fresh.keys {
        out.insert(
            kid.clone(),
            SeenKey {
                key: key.clone(),
                last_seen: now,
            },
        );
    }
    if out.len() > max {
        let mut retired: Vec<(Instant, String)> = out
            .iter()
            .filter(|(kid, _)| !fresh.keys.contains_key(*kid))
            .map(|(kid, k)| (k.last_seen, kid.clone()))
            .collect();
        retired.sort();
        for (_, kid) in retired.into_iter().take(out.len().saturating_sub(max)) {
            out.remove(&kid);
        }
    }
    out
}

/// Which of `keys` signed `token`: the key its header names first (the
/// usual case: one verification), then every other, in `kid` order.
pub fn signer_among(token: &str, keys: &HashMap<String, SeenKey>) -> Option<String> {
    let named = header_kid(token).filter(|k| keys.contains_key(k));
    if let Some(kid) = &named {
        if keys.get(kid).is_some_and(|k| verifies(token, &k.key)) {
            return Some(kid.clone());
        }
    }
    let mut rest: Vec<(&String, &SeenKey)> = keys
        .iter()
        .filter(|(kid, _)| Some(*kid) != named.as_ref())
        .collect();
    rest.sort_by(|a, b| a.0.cmp(b.0));
    rest.into_iter()
        .find(|(_, k)| verifies(token, &k.key))
        .map(|(kid, _)| kid.clone())
}

/// Whether a fetch may start now, given the last attempt.
pub fn may_fetch(last_attempt: Option<Instant>, now: Instant, min_interval: Duration) -> bool {
    last_attempt.is_none_or(|t| now.saturating_duration_since(t) >= min_interval)
}

/// A key set with the issuer it belongs to and when it was fetched.
#[derive(Debug)]
pub struct Snapshot {
    pub issuer: String,
    pub keys: KeySet,
    pub fetched: Instant,
}

/// Counters for metrics.
#[derive(Debug, Default)]
pub struct FetchStats {
    pub ok: std::sync::atomic::AtomicU64,
    pub failed: std::sync::atomic::AtomicU64,
    pub skipped: std::sync::atomic::AtomicU64,
}

/// The issuer keys of one cluster: the last good set, refreshed in place.
#[derive(Debug)]
pub struct IssuerKeys {
    source: Arc<dyn KeySource>,
    policy: RefreshPolicy,
    current: ArcSwapOption<Snapshot>,
    /// Every key seen in a fetched set, kept after the issuer drops it.
    seen: ArcSwap<HashMap<String, SeenKey>>,
    /// Serializes fetches; holds the time of the last attempt.
    fetching: tokio::sync::Mutex<Option<Instant>>,
    last_error: Mutex<Option<JwksError>>,
    pub stats: FetchStats,
    metrics: std::sync::OnceLock<Arc<super::metrics::TokenPathMetrics>>,
}

impl IssuerKeys {
    pub fn new(source: Arc<dyn KeySource>, policy: RefreshPolicy) -> Self {
        Self {
            source,
            policy,
            current: ArcSwapOption::empty(),
            seen: ArcSwap::from_pointee(HashMap::new()),
            fetching: tokio::sync::Mutex::new(None),
            last_error: Mutex::new(None),
            stats: FetchStats::default(),
            metrics: std::sync::OnceLock::new(),
        }
    }

    /// Counts fetches and exports the key count.
    pub fn with_metrics(self, metrics: Arc<super::metrics::TokenPathMetrics>) -> Self {
        let _ = self.metrics.set(metrics);
        self
    }

    fn count(&self, result: &str) {
        if let Some(m) = self.metrics.get() {
            m.jwks_fetches
                .get_or_create(&crate::metrics::ResultLabels {
                    result: result.to_string(),
                })
                .inc();
            let n = self.current().map_or(0, |c| c.keys.len());
            m.jwks_keys.set(n as i64);
        }
    }

    /// The last good key set, if any fetch ever succeeded.
    pub fn current(&self) -> Option<Arc<Snapshot>> {
        self.current.load_full()
    }

    pub fn policy(&self) -> &RefreshPolicy {
        &self.policy
    }

    /// Every key seen since start (bounded by [`MAX_SEEN_KEYS`]), the ones
    /// the issuer has dropped included.
    pub fn seen(&self) -> Arc<HashMap<String, SeenKey>> {
        self.seen.load_full()
    }

    /// The `kid` among `kids` whose remembered key verifies `token`'s
    /// signature, whatever its header says (or leaves out).
    pub fn signed_by_one_of(
        &self,
        token: &str,
        kids: &std::collections::HashSet<String>,
    ) -> Option<String> {
        let seen = self.seen.load();
        let mut named: Vec<&String> = kids.iter().filter(|k| seen.contains_key(*k)).collect();
        named.sort();
        named
            .into_iter()
            .find(|kid| seen.get(*kid).is_some_and(|k| verifies(token, &k.key)))
            .cloned()
    }

    /// The `kid` of the key that signed `token`, among every key this
    /// issuer has published since start. When none verifies it the keys
    /// are fetched again (paced by the minimum interval: a rotated key)
    /// and tried once more. `Err` says why the signer is unknown.
    pub async fn signer_of(&self, token: &str) -> Result<String, String> {
        if let Some(kid) = signer_among(token, &self.seen.load()) {
            return Ok(kid);
        }
        self.refresh().await;
        signer_among(token, &self.seen.load()).ok_or_else(|| {
            if self.current().is_none() {
                "the issuer's keys have not been fetched".to_string()
            } else {
                "no key the issuer has published since start verifies the token".to_string()
            }
        })
    }

    pub fn last_error(&self) -> Option<JwksError> {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Fetches a new set unless one was attempted within the minimum
    /// interval. Concurrent callers wait for the one fetch in progress. A
    /// failed fetch keeps the last good set. Returns whether a fetch ran.
    pub async fn refresh(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let mut last = self.fetching.lock().await;
        if !may_fetch(*last, Instant::now(), self.policy.min_interval) {
            self.stats.skipped.fetch_add(1, Relaxed);
            return false;
        }
        *last = Some(Instant::now());
        let got = match tokio::time::timeout(self.policy.timeout, self.source.fetch()).await {
            Ok(r) => r.and_then(|(issuer, body)| Ok((issuer, parse_jwks(&body)?))),
            Err(_) => Err(JwksError::Fetch(format!(
                "timed out after {:?}",
                self.policy.timeout
            ))),
        };
        let mut err = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
        match got {
            Ok((issuer, keys)) => {
                self.stats.ok.fetch_add(1, Relaxed);
                for s in &keys.skipped {
                    tracing::debug!(%issuer, skipped = %s, "JWKS key skipped");
                }
                let changed = self.current().is_none_or(|c| {
                    c.issuer != issuer || {
                        let mut a: Vec<_> = c.keys.keys.keys().collect();
                        let mut b: Vec<_> = keys.keys.keys().collect();
                        a.sort();
                        b.sort();
                        a != b
                    }
                });
                if changed {
                    let kids: Vec<_> = keys.keys.keys().cloned().collect();
                    tracing::info!(%issuer, ?kids, "ServiceAccount issuer keys loaded");
                }
                let now = Instant::now();
                self.seen.store(Arc::new(remember(
                    &self.seen.load(),
                    &keys,
                    now,
                    MAX_SEEN_KEYS,
                )));
                self.current.store(Some(Arc::new(Snapshot {
                    issuer,
                    keys,
                    fetched: now,
                })));
                *err = None;
                self.count("ok");
            }
            Err(e) => {
                self.stats.failed.fetch_add(1, Relaxed);
                tracing::warn!(error = %e, reason = e.reason(), kept_last_good = self.current().is_some(), "ServiceAccount issuer keys not refreshed");
                *err = Some(e);
                self.count("failed");
            }
        }
        true
    }

    /// Background loop: fetch at start, then every refresh interval; after
    /// a failed fetch, again every minimum interval until one succeeds (the
    /// last good set ages towards its maximum meanwhile).
    pub async fn run(self: Arc<Self>) {
        loop {
            self.refresh().await;
            let wait = if self.current().is_some() && self.last_error().is_none() {
                self.policy.interval
            } else {
                self.policy.min_interval
            };
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::atomic::{AtomicU64, Ordering};
    use test_case::test_case;

    // A real 2048-bit RSA modulus is not needed to test parsing: the key
    // bytes are only decoded, never used here.
    const N: &str = "sXchDaQebHnPiGvyDOAT4saGEUetSyo9MKLOoWFsueri23bOdgWp4Dy1WlUzewbgBHod5pcM9H95GQRV3JDXboIRROSBigeC5yjU1hGzHHyXss8UDprecbAYxknTcQkhslANGRUZmdTOQ5qTRsLAt6BTYuyvVRdhS8exSZEy_c4gs_7svlJJQ4H9_NxsiIoLwAEk7-Q3UXERGYw_75IDrGA84-lA_-Ct4eTlXHBIY2EaV7t7LjJaynVJCpkv4LKjTTAumiGUIuQhrNhZLuF_RJLqHpM2kgWFLU7-VTdL1VbC2tejvcI2BlMkEpk1BzBZI0KQB0GaDWFLN-aEAw3vRw";

    fn rsa(kid: Option<&str>, alg: Option<&str>, use_: Option<&str>) -> serde_json::Value {
        let mut k = json!({"kty": "RSA", "n": N, "e": "AQAB"});
        if let Some(kid) = kid {
            k["kid"] = json!(kid);
        }
        if let Some(a) = alg {
            k["alg"] = json!(a);
        }
        if let Some(u) = use_ {
            k["use"] = json!(u);
        }
        k
    }

    fn ec(kid: &str, crv: &str, alg: Option<&str>) -> serde_json::Value {
        let x = "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU";
        let y = "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0";
        let mut k = json!({"kty": "EC", "crv": crv, "x": x, "y": y, "kid": kid});
        if let Some(a) = alg {
            k["alg"] = json!(a);
        }
        k
    }

    fn doc(keys: Vec<serde_json::Value>) -> Vec<u8> {
        serde_json::to_vec(&json!({ "keys": keys })).unwrap()
    }

    // (document, usable kids with their algorithm, skipped count)
    #[test_case(doc(vec![rsa(Some("k1"), Some("RS256"), Some("sig"))]), &[("k1", Algorithm::RS256)], 0 ; "kubernetes rsa key")]
    #[test_case(doc(vec![rsa(Some("k1"), None, None)]), &[("k1", Algorithm::RS256)], 0 ; "rsa without alg implies rs256")]
    #[test_case(doc(vec![rsa(Some("k1"), Some("PS256"), None)]), &[("k1", Algorithm::PS256)], 0 ; "rsa pss")]
    #[test_case(doc(vec![rsa(Some("k1"), Some("RS256"), Some("enc"))]), &[], 1 ; "encryption key skipped")]
    #[test_case(doc(vec![rsa(None, Some("RS256"), None), rsa(Some("k2"), None, None)]), &[("k2", Algorithm::RS256)], 1 ; "key without kid skipped")]
    #[test_case(doc(vec![rsa(Some("k1"), Some("HS256"), None), rsa(Some("k2"), None, None)]), &[("k2", Algorithm::RS256)], 1 ; "hmac alg on an rsa key skipped")]
    #[test_case(doc(vec![rsa(Some("k1"), Some("ES256"), None), rsa(Some("k2"), None, None)]), &[("k2", Algorithm::RS256)], 1 ; "ec alg on an rsa key skipped")]
    #[test_case(doc(vec![json!({"kty": "oct", "k": "c2VjcmV0", "kid": "h"}), rsa(Some("k2"), None, None)]), &[("k2", Algorithm::RS256)], 1 ; "symmetric key skipped")]
    #[test_case(doc(vec![ec("e1", "P-256", Some("ES256")), ec("e2", "P-256", None)]), &[("e1", Algorithm::ES256), ("e2", Algorithm::ES256)], 0 ; "p256")]
    #[test_case(doc(vec![ec("e1", "P-256", Some("ES384")), rsa(Some("k2"), None, None)]), &[("k2", Algorithm::RS256)], 1 ; "curve and alg disagree")]
    fn parses(body: Vec<u8>, want: &[(&str, Algorithm)], skipped: usize) {
        match parse_jwks(&body) {
            Ok(set) => {
                let mut got: Vec<(String, Algorithm)> =
                    set.keys.iter().map(|(k, v)| (k.clone(), v.alg)).collect();
                got.sort_by(|a, b| a.0.cmp(&b.0));
                let want: Vec<(String, Algorithm)> =
                    want.iter().map(|(k, a)| (k.to_string(), *a)).collect();
                assert_eq!(got, want);
                assert_eq!(set.skipped.len(), skipped, "{:?}", set.skipped);
            }
            Err(e) => {
                assert!(want.is_empty(), "{e}");
                assert_eq!(e, JwksError::NoUsableKey);
            }
        }
    }

    #[test_case(b"not json", "jwks_document_invalid" ; "garbage")]
    #[test_case(br#"{"keys": []}"#, "jwks_no_usable_key" ; "empty")]
    #[test_case(br#"{"nokeys": 1}"#, "jwks_document_invalid" ; "no keys member")]
    fn refuses(body: &[u8], reason: &str) {
        assert_eq!(parse_jwks(body).unwrap_err().reason(), reason);
    }

    #[test_case(br#"{"issuer": "https://kubernetes.default.svc", "jwks_uri": "x"}"#, Ok("https://kubernetes.default.svc") ; "issuer")]
    #[test_case(br#"{"issuer": ""}"#, Err("jwks_discovery_invalid") ; "empty issuer")]
    #[test_case(b"<html>", Err("jwks_discovery_invalid") ; "not json")]
    fn discovery(body: &[u8], want: Result<&str, &str>) {
        let got = parse_discovery(body);
        assert_eq!(got.as_deref().map_err(JwksError::reason), want);
    }

    #[test]
    fn fetches_are_paced() {
        let t0 = Instant::now();
        let min = Duration::from_secs(30);
        assert!(may_fetch(None, t0, min));
        assert!(!may_fetch(Some(t0), t0 + Duration::from_secs(29), min));
        assert!(may_fetch(Some(t0), t0 + min, min));
        // A clock that went backwards never allows an early fetch.
        assert!(!may_fetch(Some(t0 + min), t0, min));
    }

    #[derive(Debug, Default)]
    struct Fake {
        calls: AtomicU64,
        fail: std::sync::atomic::AtomicBool,
    }

    #[tonic::async_trait]
    impl KeySource for Fake {
        async fn fetch(&self) -> Result<(String, Vec<u8>), JwksError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.fail.load(Ordering::SeqCst) {
                return Err(JwksError::Fetch("connection refused".into()));
            }
            Ok(("iss".into(), doc(vec![rsa(Some("k1"), None, None)])))
        }
    }

    #[tokio::test]
    async fn keeps_the_last_good_set_and_paces_fetches() {
        let fake = Arc::new(Fake::default());
        let policy = RefreshPolicy {
            min_interval: Duration::from_millis(200),
            ..Default::default()
        };
        let keys = IssuerKeys::new(fake.clone(), policy);
        assert!(keys.current().is_none());
        assert!(keys.refresh().await);
        assert_eq!(keys.current().unwrap().keys.len(), 1);
        // Within the minimum interval nothing is fetched, however many ask.
        let many = futures::future::join_all((0..20).map(|_| keys.refresh())).await;
        assert!(many.iter().all(|ran| !ran));
        assert_eq!(fake.calls.load(Ordering::SeqCst), 1);
        fake.fail.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(keys.refresh().await);
        assert_eq!(fake.calls.load(Ordering::SeqCst), 2);
        assert_eq!(keys.last_error().unwrap().reason(), "jwks_fetch_failed");
        assert!(
            keys.current().unwrap().keys.get("k1").is_some(),
            "outage keeps the last good set"
        );
    }
}

/// Real signing keys and a key source the tests can change, for the tests
/// of this module, `authn::local`, the cluster registry and the use case.
#[cfg(test)]
pub(crate) mod test_keys {
    use super::*;
    use aws_lc_rs::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
    use base64::Engine;
    use jsonwebtoken::{EncodingKey, Header};

    /// A P-256 key (fast to make) published under `kid`.
    pub struct EcKey {
        pub enc: EncodingKey,
        pub jwk: serde_json::Value,
    }

    pub fn ec_key(kid: &str) -> EcKey {
        let rng = aws_lc_rs::rand::SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
        let pair =
            EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref()).unwrap();
        // Uncompressed point: 0x04 || x || y.
        let point = pair.public_key().as_ref();
        let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
        EcKey {
            enc: EncodingKey::from_ec_der(pkcs8.as_ref()),
            jwk: serde_json::json!({
                "kty": "EC", "crv": "P-256", "alg": "ES256", "use": "sig", "kid": kid,
                "x": b64(&point[1..33]), "y": b64(&point[33..65]),
            }),
        }
    }

    /// A JWKS document publishing `keys`.
    pub fn doc(keys: &[&EcKey]) -> Vec<u8> {
        let keys: Vec<&serde_json::Value> = keys.iter().map(|k| &k.jwk).collect();
        serde_json::to_vec(&serde_json::json!({ "keys": keys })).unwrap()
    }

    /// `claims` signed by `key` (ES256), the header naming `kid`.
    pub fn sign(key: &EcKey, kid: Option<&str>, claims: &serde_json::Value) -> String {
        let mut h = Header::new(Algorithm::ES256);
        h.kid = kid.map(str::to_string);
        jsonwebtoken::encode(&h, claims, &key.enc).unwrap()
    }

    /// An issuer whose published document the test sets (`None`: fetches fail).
    #[derive(Debug)]
    pub struct Switch {
        pub issuer: String,
        pub doc: Mutex<Option<Vec<u8>>>,
    }

    impl Switch {
        pub fn new(issuer: &str, doc: Vec<u8>) -> Arc<Self> {
            Arc::new(Self {
                issuer: issuer.into(),
                doc: Mutex::new(Some(doc)),
            })
        }
        pub fn publish(&self, doc: Option<Vec<u8>>) {
            *self.doc.lock().unwrap() = doc;
        }
    }

    #[tonic::async_trait]
    impl KeySource for Switch {
        async fn fetch(&self) -> Result<(String, Vec<u8>), JwksError> {
            match self.doc.lock().unwrap().clone() {
                Some(d) => Ok((self.issuer.clone(), d)),
                None => Err(JwksError::Fetch("403 Forbidden".into())),
            }
        }
    }
}

#[cfg(test)]
mod signer_tests {
    use super::test_keys::{doc, ec_key, sign, Switch};
    use super::*;
    use std::collections::HashSet;
    use test_case::test_case;

    const S: fn(u64) -> Duration = Duration::from_millis;

    // (age of the set in ms, max age in ms, stale?)
    #[test_case(0, 1000, false ; "just fetched")]
    #[test_case(999, 1000, false ; "just under")]
    #[test_case(1000, 1000, false ; "exactly the max age")]
    #[test_case(1001, 1000, true ; "just over")]
    #[test_case(3_600_000, 900_000, true ; "an hour old")]
    fn age_table(age_ms: u64, max_ms: u64, stale: bool) {
        let fetched = Instant::now();
        let got = key_set_age(fetched, fetched + S(age_ms), S(max_ms));
        let want = if stale {
            KeySetAge::Stale { age: S(age_ms) }
        } else {
            KeySetAge::Fresh
        };
        assert_eq!(got, want);
    }

    #[test]
    fn a_clock_that_went_backwards_is_fresh() {
        let now = Instant::now();
        assert_eq!(key_set_age(now + S(5000), now, S(1000)), KeySetAge::Fresh);
    }

    fn set(kids: &[&str]) -> KeySet {
        let mut s = KeySet::default();
        for kid in kids {
            let k = ec_key(kid);
            s.keys.insert(
                kid.to_string(),
                VerifyKey {
                    alg: Algorithm::ES256,
                    key: DecodingKey::from_jwk(&serde_json::from_value(k.jwk).unwrap()).unwrap(),
                },
            );
        }
        s
    }

    /// Keys the issuer dropped are remembered; past the bound the ones
    /// seen longest ago go, never one the issuer still publishes.
    #[test]
    fn remembered_keys_are_bounded_oldest_first() {
        let t0 = Instant::now();
        let mut seen = HashMap::new();
        // a, b, c published in turn, one per fetch.
        for (i, kid) in ["a", "b", "c"].iter().enumerate() {
            seen = remember(&seen, &set(&[kid]), t0 + S(i as u64), 2);
        }
        let mut kids: Vec<&String> = seen.keys().collect();
        kids.sort();
        assert_eq!(kids, ["b", "c"], "a was dropped longest ago");
        // A set larger than the bound is kept whole.
        let seen = remember(&seen, &set(&["x", "y", "z"]), t0 + S(9), 2);
        let mut kids: Vec<&String> = seen.keys().collect();
        kids.sort();
        assert_eq!(kids, ["x", "y", "z"]);
        // Seen again: renewed, so another goes first.
        let mut seen = HashMap::new();
        seen = remember(&seen, &set(&["a"]), t0, 2);
        seen = remember(&seen, &set(&["b"]), t0 + S(1), 2);
        seen = remember(&seen, &set(&["a"]), t0 + S(2), 2);
        seen = remember(&seen, &set(&["c"]), t0 + S(3), 2);
        let mut kids: Vec<&String> = seen.keys().collect();
        kids.sort();
        assert_eq!(kids, ["a", "c"]);
    }

    fn claims() -> serde_json::Value {
        serde_json::json!({"iss": "iss", "sub": "x", "exp": 4_000_000_000i64})
    }

    /// A leaked key's signature is found under any header; a key that
    /// signed nothing here is never named.
    #[tokio::test]
    async fn the_signer_is_found_whatever_the_header_says() {
        let (k1, k2, stranger) = (ec_key("k1"), ec_key("k2"), ec_key("k3"));
        let src = Switch::new("iss", doc(&[&k1, &k2]));
        let unpaced = RefreshPolicy {
            min_interval: Duration::ZERO,
            ..Default::default()
        };
        let keys = IssuerKeys::new(src.clone(), unpaced);
        assert!(keys.refresh().await);
        let c = claims();
        let cases = [
            (sign(&k1, Some("k1"), &c), Ok("k1")),
            (sign(&k1, None, &c), Ok("k1")),
            (sign(&k1, Some("k2"), &c), Ok("k1")),
            (sign(&k1, Some("nobody"), &c), Ok("k1")),
            (sign(&k2, Some(""), &c), Ok("k2")),
            (sign(&stranger, None, &c), Err(())),
            (sign(&stranger, Some("k1"), &c), Err(())),
            ("not-a-jwt".to_string(), Err(())),
        ];
        for (token, want) in &cases {
            let got = keys.signer_of(token).await;
            assert_eq!(got.as_deref().map_err(|_| ()), *want, "{token}");
        }
        let deny: HashSet<String> = ["k1".to_string()].into();
        assert_eq!(
            keys.signed_by_one_of(&sign(&k1, None, &c), &deny)
                .as_deref(),
            Some("k1")
        );
        assert_eq!(keys.signed_by_one_of(&sign(&k2, None, &c), &deny), None);
        // The issuer drops k1: it no longer verifies locally, but its
        // signature is still recognised.
        src.publish(Some(doc(&[&k2])));
        assert!(keys.refresh().await);
        assert!(keys.current().unwrap().keys.get("k1").is_none());
        assert_eq!(
            keys.signed_by_one_of(&sign(&k1, None, &c), &deny)
                .as_deref(),
            Some("k1")
        );
        assert_eq!(
            keys.signer_of(&sign(&k1, None, &c)).await.as_deref(),
            Ok("k1")
        );
    }

    /// An unknown signer triggers one fetch (paced), so a key published
    /// after the last fetch is found.
    #[tokio::test]
    async fn an_unknown_signer_refetches_once_paced() {
        let (k1, k2) = (ec_key("k1"), ec_key("k2"));
        let src = Switch::new("iss", doc(&[&k1]));
        let policy = RefreshPolicy {
            min_interval: S(200),
            ..Default::default()
        };
        let keys = IssuerKeys::new(src.clone(), policy);
        let fresh = sign(&k2, None, &claims());
        // Nothing fetched yet: the first fetch decides.
        src.publish(Some(doc(&[&k1])));
        assert!(keys.signer_of(&fresh).await.is_err());
        src.publish(Some(doc(&[&k1, &k2])));
        // Within the minimum interval no second fetch: still unknown.
        assert!(keys.signer_of(&fresh).await.is_err());
        tokio::time::sleep(S(250)).await;
        assert_eq!(keys.signer_of(&fresh).await.as_deref(), Ok("k2"));
        assert_eq!(keys.stats.ok.load(std::sync::atomic::Ordering::SeqCst), 2);
    }
}
