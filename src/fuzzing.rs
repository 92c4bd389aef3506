//! Fuzz harnesses: one function per surface where attacker (or operator)
//! bytes enter, shared by the coverage-guided targets in `fuzz/` and the
//! bounded property tests in `tests/properties.rs`. Each takes raw bytes,
//! returns `Err(reason)` for an input meshca refuses, and panics only when an
//! invariant is broken, so a fuzzer crash is always a real finding.
//!
//! Input framings (documented here once; [`seeds`] writes them):
//! - `csr`: `[mode][payload]`; even mode: payload is PEM text, odd mode:
//!   payload is DER, wrapped as a `CERTIFICATE REQUEST` PEM block.
//! - `bundle`: `[now: i64 BE unix seconds][mode][part0 SEP part1 SEP part2 SEP part3]`,
//!   parts being signing cert, signing key, cert chain, root bundle; odd mode:
//!   parts 0, 1 and 3 are DER, wrapped as PEM.
//! - `audit_verify`: `[mode][log text]`; odd mode: verify with [`audit_key`].
//! - `decode_request`: protobuf `IstioCertificateRequest` bytes.
//! - `spiffe`, `token_review` (TokenReview JSON), `token_expiry`: raw bytes.

use std::sync::OnceLock;

use prost::Message;
use time::OffsetDateTime;

use crate::audit::keys::{CheckpointKey, VerifyKey};
use crate::audit::query::{query, table, Query};
use crate::audit::verify::verify_lines;
use crate::authn::token::{
    cache_action, interpret_review, precheck, token_expiry_unverified, CacheAction,
};
use crate::ca::bundle::BundleFiles;
use crate::ca::csr::{check_policy, parse_and_verify, CsrPolicy, KeyKind, San};
use crate::ca::generate::{self, InitOptions};
use crate::ca::{CaBundle, Validity};
use crate::identity::{SpiffeId, TrustDomain};
use crate::primitives::pem_encode;
use crate::proto::IstioCertificateRequest;

/// What a harness made of an input: accepted, or refused with a reason code.
pub type Outcome = Result<(), &'static str>;

/// Separates the four files of a `bundle` input.
pub const BUNDLE_SEP: &[u8] = b"\n\x00meshca-fuzz\x00\n";

/// A harness: raw input in, outcome out; panics on a broken invariant.
pub type Harness = fn(&[u8]) -> Outcome;

/// Every harness by target name (the `fuzz/` binaries are named the same).
pub const TARGETS: &[(&str, Harness)] = &[
    ("csr", csr),
    ("decode_request", decode_request),
    ("spiffe", spiffe),
    ("bundle", bundle),
    ("token_review", token_review),
    ("token_expiry", token_expiry),
    ("audit_verify", audit_verify),
];

fn default_identity() -> &'static SpiffeId {
    static ID: OnceLock<SpiffeId> = OnceLock::new();
    ID.get_or_init(|| {
        SpiffeId::new(
            TrustDomain::new("cluster.local").expect("td"),
            "default",
            "app",
        )
        .expect("id")
    })
}

/// A CA generated once per process, to issue leaves for accepted CSRs.
fn signing_bundle() -> &'static CaBundle {
    static CA: OnceLock<CaBundle> = OnceLock::new();
    CA.get_or_init(|| {
        let now = OffsetDateTime::now_utc();
        let ca = generate::generate(&InitOptions::default(), now).expect("generate CA");
        CaBundle::from_files(files_of(&ca), now).expect("generated CA loads")
    })
}

/// The `cacerts` texts of a generated CA.
pub fn files_of(ca: &generate::GeneratedCa) -> BundleFiles {
    BundleFiles::generated(ca, "fuzz")
}

/// CSR parsing, signature verification and the strict/istiod policies.
/// Invariants: an accepted CSR has a supported key; the strict policy passes
/// only a non-CA request whose SANs are exactly the authorized URI; and an
/// accepted CSR can always be signed into a leaf that chains to the root.
pub fn csr(data: &[u8]) -> Outcome {
    let Some((&mode, payload)) = data.split_first() else {
        return Err("empty");
    };
    let pem = if mode & 1 == 0 {
        String::from_utf8_lossy(payload).into_owned()
    } else {
        pem_encode("CERTIFICATE REQUEST", payload)
    };
    let v = parse_and_verify(&pem).map_err(|e| e.reason())?;
    if let KeyKind::Rsa(bits) = v.key {
        assert!((2048..=8192).contains(&bits), "RSA {bits} accepted");
    }
    // Authorize the first URI SAN that is a workload id, as a caller would be.
    let authorized = v
        .sans
        .iter()
        .find_map(|s| match s {
            San::Uri(u) => u.parse::<SpiffeId>().ok(),
            San::Other(_) => None,
        })
        .unwrap_or_else(|| default_identity().clone());
    assert_eq!(check_policy(&v, &authorized, CsrPolicy::Istiod), Ok(()));
    let strict = check_policy(&v, &authorized, CsrPolicy::Strict);
    if strict.is_ok() {
        assert!(!v.requests_ca, "strict policy passed a CA request");
        let want = San::Uri(authorized.to_string());
        assert!(
            v.sans.iter().all(|s| *s == want),
            "strict policy passed SANs {:?} for {authorized}",
            v.sans
        );
    }
    let now = OffsetDateTime::now_utc();
    let ca = signing_bundle();
    let validity = Validity {
        not_before: now - time::Duration::minutes(2),
        not_after: now + time::Duration::hours(1),
        clamped: false,
    };
    let leaf = ca
        .sign_leaf(&v.spki_der, &authorized, v.has_common_name, &validity)
        .unwrap_or_else(|e| panic!("accepted CSR cannot be signed: {e}"));
    ca.verify_leaf(&leaf.der, now)
        .unwrap_or_else(|e| panic!("leaf for an accepted CSR does not verify: {e}"));
    strict.map_err(|e| e.reason())
}

/// `grpc::decode_request` on any protobuf bytes. Invariants: the CSR and TTL
/// pass through unchanged, and an impersonation target is the non-empty
/// string value stored under `ImpersonatedIdentity`, bytes present in the
/// input; nothing else can become one.
pub fn decode_request(data: &[u8]) -> Outcome {
    use prost_types::value::Kind;
    let msg = IstioCertificateRequest::decode(data).map_err(|_| "protobuf")?;
    let stored = msg
        .metadata
        .as_ref()
        .and_then(|m| m.fields.get(crate::grpc::IMPERSONATED_IDENTITY))
        .and_then(|v| v.kind.clone());
    let (csr, ttl) = (msg.csr.clone(), msg.validity_duration);
    let req = crate::grpc::decode_request(msg).map_err(|_| "request")?;
    assert_eq!(req.csr, csr);
    assert_eq!(req.validity_secs, ttl);
    match (&req.impersonate, stored) {
        (None, None | Some(Kind::NullValue(_))) => {}
        (None, Some(Kind::StringValue(s))) => assert!(s.is_empty(), "{s:?} dropped"),
        (Some(s), Some(Kind::StringValue(v))) => {
            assert_eq!(*s, v);
            assert!(!s.is_empty());
            assert!(
                data.windows(s.len()).any(|w| w == s.as_bytes()),
                "impersonation target not in the input"
            );
        }
        (got, other) => panic!("impersonate {got:?} decoded from {other:?}"),
    }
    Ok(())
}

/// The SPIFFE parser. Invariants: a parsed id prints back byte-identical
/// and reparses to itself; a sanitised trust domain is a fixed point.
pub fn spiffe(data: &[u8]) -> Outcome {
    let s = String::from_utf8_lossy(data);
    if let Ok(td) = TrustDomain::new(&s) {
        assert_eq!(TrustDomain::new(td.as_str()).as_ref(), Ok(&td));
        assert_eq!(TrustDomain::strict(td.as_str()).as_ref(), Ok(&td));
    }
    let id: SpiffeId = s
        .parse()
        .map_err(|e: crate::identity::IdentityError| e.reason())?;
    let text = id.to_string();
    assert_eq!(text, s, "round trip");
    assert_eq!(text.parse::<SpiffeId>().as_ref(), Ok(&id));
    assert_eq!(text.matches('/').count(), 6, "{text}");
    assert!(!text.contains(','), "{text}");
    assert_eq!(
        SpiffeId::new(
            id.trust_domain().clone(),
            id.namespace(),
            id.service_account()
        )
        .as_ref(),
        Ok(&id)
    );
    Ok(())
}

/// Splits a `bundle` input into (now, files).
pub fn bundle_input(data: &[u8]) -> Option<(OffsetDateTime, BundleFiles)> {
    let (ts, rest) = data.split_first_chunk::<8>()?;
    let (&mode, rest) = rest.split_first()?;
    // The clock is the operator's, not the attacker's: keep it to sane years.
    let now = OffsetDateTime::from_unix_timestamp(
        i64::from_be_bytes(*ts).clamp(946_684_800, 4_102_444_800),
    )
    .ok()?;
    let mut parts = split_on(rest, BUNDLE_SEP).into_iter();
    let mut next = |label: &str| -> String {
        let part = parts.next().unwrap_or_default();
        if mode & 1 == 1 && !label.is_empty() {
            pem_encode(label, part)
        } else {
            String::from_utf8_lossy(part).into_owned()
        }
    };
    let files = BundleFiles {
        signing_cert: next("CERTIFICATE"),
        signing_key: next("PRIVATE KEY"),
        cert_chain: next(""),
        root_bundle: next("CERTIFICATE"),
        source: "fuzz".into(),
    };
    Some((now, files))
}

/// Encodes a `bundle` input (the inverse of [`bundle_input`] in PEM mode).
pub fn bundle_seed(now: OffsetDateTime, files: &BundleFiles) -> Vec<u8> {
    let mut out = now.unix_timestamp().to_be_bytes().to_vec();
    out.push(0);
    for (i, part) in [
        &files.signing_cert,
        &files.signing_key,
        &files.cert_chain,
        &files.root_bundle,
    ]
    .into_iter()
    .enumerate()
    {
        if i > 0 {
            out.extend_from_slice(BUNDLE_SEP);
        }
        out.extend_from_slice(part.as_bytes());
    }
    out
}

fn split_on<'a>(mut data: &'a [u8], sep: &[u8]) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    while let Some(i) = data.windows(sep.len()).position(|w| w == sep) {
        out.push(&data[..i]);
        data = &data[i + sep.len()..];
    }
    out.push(data);
    out
}

/// The CA bundle loader. Invariant: whatever it accepts can sign a leaf
/// that verifies against the accepted roots, and the response chain ends
/// with the root bundle verbatim.
pub fn bundle(data: &[u8]) -> Outcome {
    let (now, files) = bundle_input(data).ok_or("framing")?;
    let root_bundle = files.root_bundle.clone();
    let b = CaBundle::from_files(files, now).map_err(|e| e.reason())?;
    assert!(now < b.signing_not_after());
    let validity = Validity {
        not_before: now - time::Duration::minutes(1),
        not_after: (now + time::Duration::minutes(10)).min(b.signing_not_after()),
        clamped: false,
    };
    let key = rcgen::KeyPair::generate().expect("key");
    let spki = rcgen::PublicKeyData::subject_public_key_info(&key);
    let leaf = b
        .sign_leaf(&spki, default_identity(), false, &validity)
        .unwrap_or_else(|e| panic!("accepted bundle cannot sign: {e}"));
    b.verify_leaf(&leaf.der, now)
        .unwrap_or_else(|e| panic!("accepted bundle signs unverifiable leaves: {e}"));
    let chain = b.response_chain(&leaf.pem);
    if !root_bundle.is_empty() {
        assert_eq!(chain.last(), Some(&root_bundle));
    }
    Ok(())
}

/// TokenReview response decoding (the JSON the API server returns) and
/// [`interpret_review`]. Invariant: a caller is produced only for an
/// authenticated, error-free service-account review for our audience, and
/// its identity is exactly the reviewed `system:serviceaccount:<ns>:<sa>`.
pub fn token_review(data: &[u8]) -> Outcome {
    use k8s_openapi::api::authentication::v1::TokenReview;
    let review: TokenReview = serde_json::from_slice(data).map_err(|_| "json")?;
    let status = review.status.ok_or("no_status")?;
    let audiences = ["istio-ca".to_string()];
    let td = TrustDomain::new("cluster.local").expect("td");
    let caller = interpret_review(&status, &audiences, &td).map_err(|e| e.reason())?;
    assert_eq!(status.authenticated, Some(true));
    assert!(status.error.as_deref().unwrap_or_default().is_empty());
    if let Some(got) = &status.audiences {
        assert!(got.contains(&audiences[0]), "audiences {got:?}");
    }
    let user = status.user.as_ref().expect("user");
    assert!(user
        .groups
        .iter()
        .flatten()
        .any(|g| g == "system:serviceaccounts"));
    let id = &caller.identity;
    assert_eq!(
        user.username.as_deref(),
        Some(
            format!(
                "system:serviceaccount:{}:{}",
                id.namespace(),
                id.service_account()
            )
            .as_str()
        )
    );
    assert_eq!(id.trust_domain(), &td);
    assert_eq!(id.to_string().parse::<SpiffeId>().as_ref(), Ok(id));
    let kube = caller.kube.as_ref().expect("token callers carry pod info");
    assert_eq!(kube.pod_namespace, id.namespace());
    assert_eq!(kube.service_account, id.service_account());
    Ok(())
}

/// The unverified `exp` reader and the cache lifetime derived from it, on
/// the raw token and on a JWT whose payload is the input. Invariants: `exp`
/// is read exactly as a JSON parser reads it, and a cache entry never
/// outlives the token or the configured TTL.
pub fn token_expiry(data: &[u8]) -> Outcome {
    use base64::Engine;
    let raw = String::from_utf8_lossy(data);
    let _ = token_expiry_unverified(&raw);
    let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(data);
    let jwt = format!("eyJhbGciOiJSUzI1NiJ9.{payload}.sig");
    let exp = token_expiry_unverified(&jwt);
    let want = serde_json::from_slice::<serde_json::Value>(data)
        .ok()
        .and_then(|v| v.get("exp")?.as_i64());
    assert_eq!(exp, want);
    let configured = std::time::Duration::from_secs(10);
    let now = 1_700_000_000;
    for token in [&*raw, &jwt] {
        // The pre-check is only a filter; it must never panic on any input.
        let _ = precheck(token, now);
        let ttl = match cache_action(
            crate::authn::token::Outcome::Authenticated,
            token_expiry_unverified(token),
            now,
            configured,
            configured,
        ) {
            CacheAction::Positive(ttl) => Some(ttl),
            CacheAction::Nothing => None,
            CacheAction::Negative(_) => panic!("a success was cached as a refusal"),
        };
        match token_expiry_unverified(token) {
            Some(exp) if exp <= now => assert_eq!(ttl, None, "expired token cached"),
            Some(exp) => {
                let ttl = ttl.expect("live token cached");
                assert!(ttl <= configured);
                assert!(ttl.as_secs() as i128 <= exp as i128 - now as i128);
            }
            None => assert_eq!(ttl, Some(configured)),
        }
    }
    exp.map(|_| ()).ok_or("no_exp")
}

/// The fixed Ed25519 key that signs the `audit_verify` seed logs (a test
/// key, derived from a constant so fuzz inputs reproduce anywhere).
pub fn audit_key() -> CheckpointKey {
    CheckpointKey::from_pem(audit_key_pem().as_bytes()).expect("test key")
}

/// [`audit_key`] as PKCS#8 PEM.
pub fn audit_key_pem() -> String {
    // PKCS#8 v1 Ed25519 private key prefix, then the 32-byte seed.
    let mut der = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    der.extend_from_slice(&[0x42; 32]);
    pem_encode("PRIVATE KEY", &der)
}

fn audit_verify_key() -> &'static VerifyKey {
    static KEY: OnceLock<VerifyKey> = OnceLock::new();
    KEY.get_or_init(|| audit_key().verify_key())
}

/// Lines as `meshca audit verify` reads them from a file.
pub fn log_lines(text: &str) -> Vec<(String, String)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (format!("audit.log:{}", i + 1), l.to_string()))
        .collect()
}

/// `audit verify` (and `audit query`) on any log text. Invariants: an
/// accepted log accounts for every line, and with a key every checkpoint
/// was verified; a refusal names a line of the input.
pub fn audit_verify(data: &[u8]) -> Outcome {
    let (&mode, rest) = data.split_first().ok_or("empty")?;
    // `read_lines` refuses non-UTF-8 files before verification starts.
    let text = std::str::from_utf8(rest).map_err(|_| "not_utf8")?;
    let lines = log_lines(text);
    let key = (mode & 1 == 1).then(audit_verify_key);
    let (records, _unreadable) = query(&lines, &Query::default());
    let _ = table(&records);
    match verify_lines(&lines, key) {
        Ok(r) => {
            // Every line is a record, a checkpoint, or damage that a recovery
            // checkpoint right after it accounts for.
            let damaged: u64 = r
                .recoveries
                .iter()
                .filter(|n| n.damaged_lines_checked)
                .map(|n| n.recovery.damaged_lines)
                .sum();
            assert_eq!(r.records + r.checkpoints + damaged, lines.len() as u64);
            if key.is_some() {
                assert_eq!(r.signed_checkpoints, r.checkpoints);
            }
            assert!(r.unsigned_tail <= r.records);
            Ok(())
        }
        Err(f) => {
            assert!(
                lines.iter().any(|(loc, _)| *loc == f.location),
                "failure location {} is not a line",
                f.location
            );
            Err("refused")
        }
    }
}

/// Seed corpora made from real meshca outputs (`scripts/fuzz` writes them
/// under `fuzz/corpus/<target>/`).
pub mod seeds {
    use std::path::Path;

    use rcgen::{KeyPair, SanType};

    use super::*;
    use crate::testing::{csr_for, csr_pem};

    /// Real CSRs: every supported key type, a CN, DNS/IP SANs, a CA
    /// request, and the refused fixtures (DSA, SHA-1, RSA-1024).
    pub fn csrs() -> Vec<(String, Vec<u8>)> {
        let id = "spiffe://cluster.local/ns/default/sa/app";
        let mut out = Vec::new();
        let mut add = |name: &str, pem: String| {
            let der = rustls_pki_types::pem::PemObject::from_pem_slice(pem.as_bytes())
                .map(|d: rustls_pki_types::CertificateSigningRequestDer<'_>| d.as_ref().to_vec())
                .unwrap_or_default();
            out.push((format!("{name}-pem"), [&[0u8][..], pem.as_bytes()].concat()));
            out.push((format!("{name}-der"), [&[1u8][..], &der].concat()));
        };
        for (name, alg) in [
            ("p256", &rcgen::PKCS_ECDSA_P256_SHA256),
            ("p384", &rcgen::PKCS_ECDSA_P384_SHA384),
            ("ed25519", &rcgen::PKCS_ED25519),
        ] {
            let key = KeyPair::generate_for(alg).expect("key");
            add(name, csr_for(&key, id));
        }
        let rsa = KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, rcgen::RsaKeySize::_2048)
            .expect("rsa");
        add("rsa2048", csr_for(&rsa, id));
        let key = KeyPair::generate().expect("key");
        add("ca-request", csr_pem(&key, &[], true));
        add(
            "dns-ip-sans",
            csr_pem(
                &key,
                &[
                    SanType::DnsName("evil.example".try_into().expect("dns")),
                    SanType::IpAddress([10, 0, 0, 1].into()),
                    SanType::URI(id.try_into().expect("uri")),
                ],
                false,
            ),
        );
        let mut params = rcgen::CertificateParams::default();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, id);
        params.subject_alt_names = vec![SanType::URI(id.try_into().expect("uri"))];
        add(
            "common-name",
            params
                .serialize_request(&key)
                .and_then(|c| c.pem())
                .expect("csr"),
        );
        out
    }

    fn value(kind: prost_types::value::Kind) -> prost_types::Value {
        prost_types::Value { kind: Some(kind) }
    }

    /// Request messages as ztunnel and istio-agent send them, and wrong types.
    pub fn requests(csr: &str) -> Vec<(String, Vec<u8>)> {
        use prost_types::value::Kind;
        let s = |v: &str| value(Kind::StringValue(v.into()));
        let imp = crate::grpc::IMPERSONATED_IDENTITY;
        let signer = crate::grpc::CERT_SIGNER;
        let cases: Vec<(&str, Vec<(&str, prost_types::Value)>)> = vec![
            ("plain", vec![]),
            ("agent", vec![(signer, s(""))]),
            (
                "ztunnel",
                vec![(imp, s("spiffe://cluster.local/ns/app/sa/web"))],
            ),
            ("null", vec![(imp, value(Kind::NullValue(0)))]),
            ("number", vec![(imp, value(Kind::NumberValue(1.0)))]),
            ("bool-signer", vec![(signer, value(Kind::BoolValue(true)))]),
            (
                "list",
                vec![(
                    imp,
                    value(Kind::ListValue(prost_types::ListValue {
                        values: vec![s("spiffe://cluster.local/ns/a/sa/b")],
                    })),
                )],
            ),
        ];
        cases
            .into_iter()
            .map(|(name, md)| {
                let msg = crate::testing::request(csr.to_string(), 3600, &md);
                (name.to_string(), msg.encode_to_vec())
            })
            .collect()
    }

    /// TokenReview responses as the API server returns them.
    pub fn token_reviews() -> Vec<(String, Vec<u8>)> {
        let sa_user = |name: &str, extra: bool| {
            let mut user = serde_json::json!({
                "username": format!("system:serviceaccount:istio-system:{name}"),
                "uid": "5a8f0c2e-0000-4000-8000-000000000001",
                "groups": ["system:serviceaccounts", "system:serviceaccounts:istio-system", "system:authenticated"],
            });
            if extra {
                user["extra"] = serde_json::json!({
                    "authentication.kubernetes.io/credential-id": ["JTI=abc"],
                    "authentication.kubernetes.io/node-name": ["node-a"],
                    "authentication.kubernetes.io/node-uid": ["n-1"],
                    "authentication.kubernetes.io/pod-name": ["ztunnel-x1"],
                    "authentication.kubernetes.io/pod-uid": ["p-1"],
                });
            }
            user
        };
        let review = |status: serde_json::Value| {
            serde_json::to_vec(&serde_json::json!({
                "kind": "TokenReview",
                "apiVersion": "authentication.k8s.io/v1",
                "metadata": {"creationTimestamp": null},
                "spec": {"token": "redacted", "audiences": ["istio-ca"]},
                "status": status,
            }))
            .expect("json")
        };
        vec![
            (
                "pod-token".into(),
                review(serde_json::json!({
                    "authenticated": true, "user": sa_user("ztunnel", true), "audiences": ["istio-ca"]
                })),
            ),
            (
                "plain-token".into(),
                review(serde_json::json!({"authenticated": true, "user": sa_user("app", false)})),
            ),
            (
                "wrong-audience".into(),
                review(serde_json::json!({
                    "authenticated": true, "user": sa_user("app", false), "audiences": ["api"]
                })),
            ),
            (
                "unauthenticated".into(),
                review(serde_json::json!({
                    "authenticated": false, "error": "[invalid bearer token, token has been invalidated]", "user": {}
                })),
            ),
            (
                "not-sa".into(),
                review(serde_json::json!({
                    "authenticated": true,
                    "user": {"username": "kubernetes-admin", "groups": ["system:masters", "system:authenticated"]}
                })),
            ),
        ]
    }

    /// JWT payloads (the fuzzed input of `token_expiry`).
    pub fn token_payloads() -> Vec<(String, Vec<u8>)> {
        [
            ("k8s", &br#"{"aud":["istio-ca"],"exp":1764000000,"iat":1763996400,"iss":"https://kubernetes.default.svc.cluster.local","kubernetes.io":{"namespace":"app","serviceaccount":{"name":"web","uid":"u"}},"nbf":1763996400,"sub":"system:serviceaccount:app:web"}"#[..]),
            ("no-exp", br#"{"sub":"x"}"#),
            ("big-exp", br#"{"exp":9223372036854775807}"#),
        ]
        .into_iter()
        .map(|(n, b)| (n.to_string(), b.to_vec()))
        .collect()
    }

    /// Writes every target's seeds under `dir/<target>/`; returns how many.
    pub async fn write_all(dir: &Path) -> anyhow::Result<usize> {
        let mut n = 0;
        let mut write = |target: &str, name: &str, data: &[u8]| -> anyhow::Result<()> {
            let d = dir.join(target);
            std::fs::create_dir_all(&d)?;
            std::fs::write(d.join(format!("seed-{name}")), data)?;
            n += 1;
            Ok(())
        };
        let csrs = csrs();
        for (name, data) in &csrs {
            write("csr", name, data)?;
        }
        let key = KeyPair::generate()?;
        for (name, data) in requests(&csr_for(&key, "spiffe://cluster.local/ns/app/sa/web")) {
            write("decode_request", &name, &data)?;
        }
        for (name, id) in [
            ("workload", "spiffe://cluster.local/ns/default/sa/app"),
            ("ztunnel", "spiffe://example.com/ns/istio-system/sa/ztunnel"),
            ("td-config", "Foo@Cluster.Local"),
        ] {
            write("spiffe", name, id.as_bytes())?;
        }
        let now = OffsetDateTime::now_utc();
        for (name, key_type) in [
            ("p256", generate::KeyType::EcdsaP256),
            ("rsa2048", generate::KeyType::Rsa2048),
        ] {
            let ca = generate::generate(
                &InitOptions {
                    key_type,
                    ..Default::default()
                },
                now,
            )?;
            write("bundle", name, &bundle_seed(now, &files_of(&ca)))?;
        }
        for (name, data) in token_reviews() {
            write("token_review", &name, &data)?;
        }
        for (name, data) in token_payloads() {
            write("token_expiry", &name, &data)?;
        }
        let log = real_audit_log().await?;
        write(
            "audit_verify",
            "signed",
            &[&[1u8][..], log.as_bytes()].concat(),
        )?;
        write(
            "audit_verify",
            "unkeyed",
            &[&[0u8][..], log.as_bytes()].concat(),
        )?;
        Ok(n)
    }

    /// An audit log written by a real server (file sink, checkpoints signed
    /// with [`audit_key`]) for real mTLS calls: an issued certificate, a
    /// denied impersonation, a refused CSR; ends with the shutdown checkpoint.
    pub async fn real_audit_log() -> anyhow::Result<String> {
        use crate::testing::{client, client_identity, request, string_value, TestPki};
        let pki = TestPki::new(generate::KeyType::EcdsaP256);
        let dir = tempfile::tempdir()?;
        let key_path = dir.path().join("checkpoint.pem");
        std::fs::write(&key_path, audit_key_pem())?;
        let mut cfg = crate::testing::test_config(pki.path_buf());
        cfg.audit.sink = crate::config::AuditSinkKind::File;
        cfg.audit.file = dir.path().join("audit.log");
        cfg.audit.checkpoint_key = Some(key_path);
        cfg.audit.checkpoint_every = 2;
        let app = crate::app::App::start(&cfg, crate::app::Deps::default()).await?;
        let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc())?;
        let me = "spiffe://cluster.local/ns/default/sa/client";
        let (cert, key) = client_identity(&bundle, me, &crate::testing::validity_hours(-1, 1));
        let mut c = client(app.addr, &pki.ca.root_cert, Some((&cert, &key))).await?;
        let leaf = KeyPair::generate()?;
        c.create_certificate(request(csr_for(&leaf, me), 3600, &[]))
            .await?;
        let other = "spiffe://cluster.local/ns/app/sa/web";
        let denied = c
            .create_certificate(request(
                csr_for(&leaf, other),
                3600,
                &[(crate::grpc::IMPERSONATED_IDENTITY, string_value(other))],
            ))
            .await;
        anyhow::ensure!(denied.is_err(), "impersonation was not denied");
        let refused = c
            .create_certificate(request("not a csr".into(), 3600, &[]))
            .await;
        anyhow::ensure!(refused.is_err(), "garbage CSR was not refused");
        drop(c);
        app.shutdown().await?;
        Ok(std::fs::read_to_string(dir.path().join("audit.log"))?)
    }
}
