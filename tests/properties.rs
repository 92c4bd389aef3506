//! Property tests over the surfaces where hostile bytes enter meshca: the
//! same harnesses and invariants as the coverage-guided targets in `fuzz/`
//! (`meshca::fuzzing`), run for a bounded number of cases on inputs derived
//! from real meshca outputs. `PROPTEST_CASES` scales every test.
#![allow(clippy::unwrap_used)]

use std::sync::OnceLock;

use meshca::audit::verify::verify_lines;
use meshca::ca::csr::parse_and_verify;
use meshca::ca::generate::{self, InitOptions};
use meshca::ca::CaBundle;
use meshca::fuzzing::{self, seeds};
use meshca::identity::SpiffeId;
use meshca::primitives::pem_encode;
use proptest::prelude::*;
use prost::Message;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use time::OffsetDateTime;

fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(cases);
    ProptestConfig {
        cases,
        // Regressions are turned into named unit tests instead.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// One edit of a byte string.
#[derive(Debug, Clone)]
enum Edit {
    Set(usize, u8),
    Xor(usize, u8),
    Insert(usize, u8),
    Remove(usize),
    Truncate(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        (any::<usize>(), 1..=255u8).prop_map(|(i, b)| Edit::Xor(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Insert(i, b)),
        any::<usize>().prop_map(Edit::Remove),
        any::<usize>().prop_map(Edit::Truncate),
    ]
}

fn apply(data: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut d = data.to_vec();
    for e in edits {
        let n = d.len();
        match *e {
            Edit::Set(i, b) if n > 0 => d[i % n] = b,
            Edit::Xor(i, b) if n > 0 => d[i % n] ^= b,
            Edit::Insert(i, b) => d.insert(i % (n + 1), b),
            Edit::Remove(i) if n > 0 => {
                d.remove(i % n);
            }
            Edit::Truncate(i) => d.truncate(i % (n + 1)),
            _ => {}
        }
    }
    d
}

// ---------------------------------------------------------------- CSR

fn csr_seeds() -> &'static [(String, Vec<u8>)] {
    static S: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    S.get_or_init(seeds::csrs)
}

proptest! {
    #![proptest_config(config(192))]

    /// A mutated CSR is refused, or (if some encoding slack is tolerated)
    /// asks for exactly what the original asked for: no mutation can change
    /// the key, SANs, CA flag or CN that reach policy and the certificate.
    #[test]
    fn csr_mutations_never_change_the_request(
        pick in any::<prop::sample::Index>(),
        edits in prop::collection::vec(edit(), 1..4),
    ) {
        let (name, seed) = pick.get(csr_seeds());
        let (mode, payload) = seed.split_first().unwrap();
        let mutated = [&[*mode][..], &apply(payload, &edits)].concat();
        // The harness asserts policy and signability of anything accepted.
        let _ = fuzzing::csr(&mutated);
        let to_pem = |d: &[u8]| if mode & 1 == 1 {
            pem_encode("CERTIFICATE REQUEST", &d[1..])
        } else {
            String::from_utf8_lossy(&d[1..]).into_owned()
        };
        if let (Ok(orig), Ok(got)) = (parse_and_verify(&to_pem(seed)), parse_and_verify(&to_pem(&mutated))) {
            prop_assert_eq!(&orig.spki_der, &got.spki_der, "{}", name);
            prop_assert_eq!(&orig.sans, &got.sans, "{}", name);
            prop_assert_eq!(orig.requests_ca, got.requests_ca, "{}", name);
            prop_assert_eq!(orig.has_common_name, got.has_common_name, "{}", name);
        }
    }

    /// Any single changed byte of a CSR's signed part (the request info)
    /// or of its signature is refused. (Bytes of the outer envelope can be
    /// tolerated by the DER parser, e.g. the tag class of the signature
    /// algorithm OID; they do not change what is requested, which the test
    /// above asserts.)
    #[test]
    fn csr_single_byte_change_is_refused(
        pick in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
        xor in 1..=255u8,
    ) {
        use x509_parser::certification_request::X509CertificationRequest;
        use x509_parser::prelude::FromDer;
        let ders: Vec<_> = csr_seeds().iter().filter(|(n, _)| n.ends_with("-der")).collect();
        let (name, seed) = pick.get(&ders);
        let mut der = seed[1..].to_vec();
        let (_, parsed) = X509CertificationRequest::from_der(&seed[1..]).unwrap();
        let offset = |part: &[u8]| part.as_ptr() as usize - seed[1..].as_ptr() as usize;
        let info = parsed.certification_request_info.raw;
        let sig = parsed.signature_value.data.as_ref();
        let signed = offset(info)..offset(info) + info.len();
        let signature = offset(sig)..offset(sig) + sig.len();
        let k = at.index(signed.len() + signature.len());
        let i = if k < signed.len() { signed.start + k } else { signature.start + k - signed.len() };
        der[i] ^= xor;
        let got = parse_and_verify(&pem_encode("CERTIFICATE REQUEST", &der));
        prop_assert!(got.is_err(), "{} byte {} ^ {:#x} accepted", name, i, xor);
    }

    #[test]
    fn csr_arbitrary_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..600)) {
        let _ = fuzzing::csr(&data);
    }
}

// ---------------------------------------------------------------- requests

fn kind() -> impl Strategy<Value = prost_types::value::Kind> {
    use prost_types::value::Kind;
    prop_oneof![
        ".{0,40}".prop_map(Kind::StringValue),
        Just(Kind::StringValue(
            "spiffe://cluster.local/ns/app/sa/web".into()
        )),
        Just(Kind::StringValue(String::new())),
        any::<f64>().prop_map(Kind::NumberValue),
        any::<bool>().prop_map(Kind::BoolValue),
        Just(Kind::NullValue(0)),
        prop::collection::vec(".{0,10}", 0..3).prop_map(|v| Kind::ListValue(
            prost_types::ListValue {
                values: v
                    .into_iter()
                    .map(|s| prost_types::Value {
                        kind: Some(Kind::StringValue(s))
                    })
                    .collect(),
            }
        )),
    ]
}

fn metadata_key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(meshca::grpc::IMPERSONATED_IDENTITY.to_string()),
        Just(meshca::grpc::CERT_SIGNER.to_string()),
        Just("impersonatedidentity".to_string()),
        ".{0,20}",
    ]
}

proptest! {
    #![proptest_config(config(512))]

    /// Requests as a hostile client could encode them, then optionally
    /// corrupted on the wire: decoding never panics, and an impersonation
    /// target is only ever the string sent under `ImpersonatedIdentity`.
    #[test]
    fn decoded_request_never_invents_an_impersonation(
        csr in ".{0,64}",
        ttl in any::<i64>(),
        fields in prop::collection::btree_map(metadata_key(), kind(), 0..5),
        with_metadata in any::<bool>(),
        edits in prop::collection::vec(edit(), 0..3),
    ) {
        let msg = meshca::proto::IstioCertificateRequest {
            csr,
            validity_duration: ttl,
            metadata: with_metadata.then(|| prost_types::Struct {
                fields: fields.clone().into_iter().map(|(k, v)| (k, prost_types::Value { kind: Some(v) })).collect(),
            }),
        };
        let bytes = apply(&msg.encode_to_vec(), &edits);
        let _ = fuzzing::decode_request(&bytes);
        if edits.is_empty() {
            let sent = fields.get(meshca::grpc::IMPERSONATED_IDENTITY).filter(|_| with_metadata);
            if let Ok(req) = meshca::grpc::decode_request(msg) {
                match (sent, req.impersonate) {
                    (_, None) => {}
                    (Some(prost_types::value::Kind::StringValue(s)), Some(got)) => prop_assert_eq!(s, &got),
                    (other, Some(got)) => prop_assert!(false, "{:?} from {:?}", got, other),
                }
            }
        }
    }

    #[test]
    fn request_arbitrary_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = fuzzing::decode_request(&data);
    }
}

// ---------------------------------------------------------------- SPIFFE

proptest! {
    #![proptest_config(config(512))]

    /// Every well-formed workload id parses into its parts and prints back
    /// byte-identical.
    #[test]
    fn spiffe_round_trips(
        td in "[a-z0-9._-]{1,40}",
        ns in "[A-Za-z0-9._-]{1,40}",
        sa in "[A-Za-z0-9._-]{1,40}",
    ) {
        let s = format!("spiffe://{td}/ns/{ns}/sa/{sa}");
        let id: SpiffeId = s.parse().unwrap();
        prop_assert_eq!(id.trust_domain().as_str(), td.as_str());
        prop_assert_eq!(id.namespace(), ns.as_str());
        prop_assert_eq!(id.service_account(), sa.as_str());
        prop_assert_eq!(id.to_string(), s.clone());
        prop_assert_eq!(fuzzing::spiffe(s.as_bytes()), Ok(()));
    }

    /// Near-misses (any characters in any segment) never panic, and what is
    /// accepted round-trips and cannot carry a comma or an extra slash.
    #[test]
    fn spiffe_near_misses(
        td in "[a-zA-Z0-9.,@/ _:-]{0,12}",
        ns in "[a-zA-Z0-9.,/ _:%-]{0,12}",
        sa in "[a-zA-Z0-9.,/ _:%-]{0,12}",
        junk in ".{0,40}",
    ) {
        let _ = fuzzing::spiffe(format!("spiffe://{td}/ns/{ns}/sa/{sa}").as_bytes());
        let _ = fuzzing::spiffe(junk.as_bytes());
        let _ = fuzzing::spiffe(format!("spiffe://{junk}").as_bytes());
    }
}

// ---------------------------------------------------------------- CA bundle

struct RealBundle {
    now: OffsetDateTime,
    files: meshca::ca::bundle::BundleFiles,
    signing_der: Vec<u8>,
}

fn real_bundle() -> &'static RealBundle {
    static B: OnceLock<RealBundle> = OnceLock::new();
    B.get_or_init(|| {
        let now = OffsetDateTime::now_utc();
        let ca = generate::generate(&InitOptions::default(), now).unwrap();
        let files = fuzzing::files_of(&ca);
        let signing_der = CertificateDer::from_pem_slice(files.signing_cert.as_bytes())
            .unwrap()
            .to_vec();
        RealBundle {
            now,
            files,
            signing_der,
        }
    })
}

proptest! {
    #![proptest_config(config(64))]

    /// Mutating any one of the four files (as text, or the DER inside a
    /// certificate) never panics the loader, and whatever it still accepts
    /// signs leaves that verify (asserted by the harness).
    #[test]
    fn bundle_mutations_never_panic(
        file in 0..4usize,
        as_der in any::<bool>(),
        edits in prop::collection::vec(edit(), 1..4),
    ) {
        let b = real_bundle();
        let mut files = b.files.clone();
        let target = match file {
            0 => &mut files.signing_cert,
            1 => &mut files.signing_key,
            2 => &mut files.cert_chain,
            _ => &mut files.root_bundle,
        };
        let label = if file == 1 { "PRIVATE KEY" } else { "CERTIFICATE" };
        *target = match (as_der, CertificateDer::from_pem_slice(target.as_bytes())) {
            (true, Ok(der)) if file != 1 => pem_encode(label, &apply(&der, &edits)),
            _ => String::from_utf8_lossy(&apply(target.as_bytes(), &edits)).into_owned(),
        };
        let _ = fuzzing::bundle(&fuzzing::bundle_seed(b.now, &files));
    }

    /// Any single changed byte of the signing certificate's DER is refused:
    /// the root's signature covers it.
    #[test]
    fn bundle_signing_cert_byte_change_is_refused(at in any::<prop::sample::Index>(), xor in 1..=255u8) {
        let b = real_bundle();
        let mut der = b.signing_der.clone();
        let i = at.index(der.len());
        der[i] ^= xor;
        let mut files = b.files.clone();
        files.signing_cert = pem_encode("CERTIFICATE", &der);
        prop_assert!(CaBundle::from_files(files, b.now).is_err(), "byte {} ^ {:#x} accepted", i, xor);
    }
}

// ---------------------------------------------------------------- TokenReview

fn username() -> impl Strategy<Value = Option<String>> {
    prop::option::of(prop_oneof![
        ("[a-z0-9-]{1,12}", "[a-z0-9-]{1,12}")
            .prop_map(|(ns, sa)| format!("system:serviceaccount:{ns}:{sa}")),
        ("[a-z:/.,-]{0,8}", "[a-zA-Z:/., -]{0,8}")
            .prop_map(|(ns, sa)| format!("system:serviceaccount:{ns}:{sa}")),
        ".{0,40}",
    ])
}

proptest! {
    #![proptest_config(config(512))]

    /// TokenReview statuses of every shape, through the API server's JSON:
    /// a caller comes out exactly when an independent oracle says so.
    #[test]
    fn token_review_accepts_exactly_service_accounts(
        authenticated in prop::option::of(any::<bool>()),
        error in prop::option::of(prop_oneof![Just(String::new()), ".{1,20}"]),
        audiences in prop::option::of(prop::collection::vec(prop_oneof![Just("istio-ca".to_string()), "[a-z-]{0,10}"], 0..3)),
        username in username(),
        groups in prop::option::of(prop::sample::subsequence(
            vec!["system:serviceaccounts", "system:authenticated", "system:serviceaccounts:app", "system:masters"], 0..4)),
        pod in prop::option::of("[a-z0-9-]{0,12}"),
    ) {
        let mut user = serde_json::json!({});
        if let Some(u) = &username { user["username"] = u.clone().into(); }
        if let Some(g) = &groups { user["groups"] = g.clone().into(); }
        if let Some(p) = &pod {
            user["extra"] = serde_json::json!({"authentication.kubernetes.io/pod-name": [p]});
        }
        let mut status = serde_json::json!({"user": user});
        if let Some(a) = authenticated { status["authenticated"] = a.into(); }
        if let Some(e) = &error { status["error"] = e.clone().into(); }
        if let Some(a) = &audiences { status["audiences"] = a.clone().into(); }
        let json = serde_json::to_vec(&serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {}, "status": status,
        })).unwrap();
        let got = fuzzing::token_review(&json);
        let segment = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        let shape_ok = username.as_deref().is_some_and(|u| {
            let p: Vec<_> = u.split(':').collect();
            p.len() == 4 && p[0] == "system" && p[1] == "serviceaccount" && segment(p[2]) && segment(p[3])
        });
        let want = authenticated == Some(true)
            && error.as_deref().unwrap_or_default().is_empty()
            && audiences.as_ref().is_none_or(|a| a.iter().any(|a| a == "istio-ca"))
            && groups.as_ref().is_some_and(|g| g.contains(&"system:serviceaccounts"))
            && shape_ok;
        prop_assert_eq!(got.is_ok(), want, "{:?}", got);
    }

    /// Mutated TokenReview JSON never panics.
    #[test]
    fn token_review_mutations_never_panic(
        pick in any::<prop::sample::Index>(),
        edits in prop::collection::vec(edit(), 1..5),
    ) {
        let seeds = seeds::token_reviews();
        let (_, seed) = pick.get(&seeds);
        let _ = fuzzing::token_review(&apply(seed, &edits));
    }

    /// Any `exp` a token can carry: read exactly, and a cache entry never
    /// outlives the token (no overflow at the edges of i64).
    #[test]
    fn token_expiry_any_exp(exp in prop_oneof![any::<i64>(), Just(i64::MIN), Just(i64::MAX), -10i64..10]) {
        let payload = format!(r#"{{"sub":"system:serviceaccount:a:b","exp":{exp}}}"#);
        prop_assert_eq!(fuzzing::token_expiry(payload.as_bytes()), Ok(()));
    }

    #[test]
    fn token_expiry_arbitrary_bytes(data in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = fuzzing::token_expiry(&data);
    }
}

// ---------------------------------------------------------------- audit log

fn real_log() -> &'static str {
    static LOG: OnceLock<String> = OnceLock::new();
    LOG.get_or_init(|| {
        tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(seeds::real_audit_log())
            .unwrap()
    })
}

proptest! {
    #![proptest_config(config(384))]

    /// Any single-byte change of a signed log (ending in its shutdown
    /// checkpoint) is flagged by `audit verify` with the key, including the
    /// last checkpoint's unsigned `alg`/`key_id` members and its framing.
    #[test]
    fn audit_single_byte_change_is_flagged(at in any::<prop::sample::Index>(), byte in 0u8..0x80) {
        let log = real_log().as_bytes();
        let i = at.index(log.len());
        prop_assume!(log[i] != byte);
        let mut m = log.to_vec();
        m[i] = byte;
        let text = String::from_utf8(m).unwrap();
        let key = fuzzing::audit_key().verify_key();
        let got = verify_lines(&fuzzing::log_lines(&text), Some(&key));
        prop_assert!(got.is_err(), "byte {} {:?} -> {:?} accepted: {:?}", i, log[i] as char, byte as char, got);
    }

    /// Arbitrary edits, line drops and swaps never panic.
    #[test]
    fn audit_mutations_never_panic(
        keyed in any::<bool>(),
        edits in prop::collection::vec(edit(), 0..4),
        drop_line in any::<Option<prop::sample::Index>>(),
        swap in any::<Option<(prop::sample::Index, prop::sample::Index)>>(),
    ) {
        let mut lines: Vec<&str> = real_log().lines().collect();
        if let Some(i) = drop_line { lines.remove(i.index(lines.len())); }
        if let Some((a, b)) = swap { let n = lines.len(); lines.swap(a.index(n), b.index(n)); }
        let text = lines.join("\n");
        let data = [&[u8::from(keyed)][..], &apply(text.as_bytes(), &edits)].concat();
        let _ = fuzzing::audit_verify(&data);
    }
}

/// Edits of the last line that no later line's `prev` covers: the final
/// checkpoint's `alg` and `key_id` (not in the signed message) and padding
/// in place of the final newline. Found by fuzzing; `audit verify` binds
/// them to the given key and rejects padded lines.
#[test]
fn last_checkpoint_unsigned_fields_are_flagged() {
    let log = real_log();
    let key = fuzzing::audit_key().verify_key();
    let replace_last = |from: &str, to: &str| {
        let at = log.rfind(from).unwrap();
        format!("{}{to}{}", &log[..at], &log[at + from.len()..])
    };
    // Each edit changes only the last line.
    let edits = [
        replace_last(r#""alg":"ed25519""#, r#""alg":"none""#),
        replace_last(r#""key_id":"#, r#""key_iX":"#),
        format!("{} ", log.trim_end_matches('\n')),
        // Found by audit_single_byte_change_is_flagged: a renamed or dropped
        // v2 member read as absent, and the signed message counts absent as 0.
        replace_last(r#""shed":"#, r#""shxd":"#),
        replace_last(r#","shed":0"#, ""),
        replace_last(r#""count":"#, r#""cxunt":"#),
        replace_last(r#""replica":"#, r#""replicX":"#),
    ];
    for (n, edited) in edits.iter().enumerate() {
        let got = verify_lines(&fuzzing::log_lines(edited), Some(&key));
        assert!(got.is_err(), "edit {n} accepted: {got:?}");
    }
}

// ---------------------------------------------------------------- seeds

/// The fuzz seed corpora are real meshca outputs that the harnesses accept
/// (or refuse with the expected reason). With `MESHCA_FUZZ_SEEDS=<dir>` the
/// seeds are kept there (`scripts/fuzz` uses this).
#[tokio::test]
async fn fuzz_seeds_are_real_meshca_outputs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = std::env::var_os("MESHCA_FUZZ_SEEDS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| tmp.path().to_path_buf());
    let n = seeds::write_all(&dir).await.unwrap();
    assert!(n >= 30, "{n} seeds");
    let outcome = |target: &str, name: &str| {
        let harness = fuzzing::TARGETS
            .iter()
            .find(|(t, _)| *t == target)
            .unwrap()
            .1;
        harness(&std::fs::read(dir.join(target).join(format!("seed-{name}"))).unwrap())
    };
    for name in ["p256", "p384", "ed25519", "rsa2048", "common-name"] {
        assert_eq!(outcome("csr", &format!("{name}-pem")), Ok(()), "{name}");
        assert_eq!(outcome("csr", &format!("{name}-der")), Ok(()), "{name}");
    }
    assert_eq!(outcome("csr", "ca-request-der"), Err("csr_requests_ca"));
    assert_eq!(
        outcome("csr", "dns-ip-sans-pem"),
        Err("csr_san_not_authorized")
    );
    for name in ["plain", "agent", "ztunnel", "null"] {
        assert_eq!(outcome("decode_request", name), Ok(()), "{name}");
    }
    for name in ["number", "bool-signer", "list"] {
        assert_eq!(outcome("decode_request", name), Err("request"), "{name}");
    }
    assert_eq!(outcome("spiffe", "workload"), Ok(()));
    assert_eq!(outcome("spiffe", "ztunnel"), Ok(()));
    assert_eq!(outcome("bundle", "p256"), Ok(()));
    assert_eq!(outcome("bundle", "rsa2048"), Ok(()));
    assert_eq!(outcome("token_review", "pod-token"), Ok(()));
    assert_eq!(outcome("token_review", "plain-token"), Ok(()));
    assert_eq!(
        outcome("token_review", "wrong-audience"),
        Err("token_audience_mismatch")
    );
    assert_eq!(
        outcome("token_review", "unauthenticated"),
        Err("token_not_authenticated")
    );
    assert_eq!(
        outcome("token_review", "not-sa"),
        Err("token_not_service_account")
    );
    assert_eq!(outcome("token_expiry", "k8s"), Ok(()));
    assert_eq!(outcome("token_expiry", "big-exp"), Ok(()));
    assert_eq!(outcome("token_expiry", "no-exp"), Err("no_exp"));
    assert_eq!(outcome("audit_verify", "signed"), Ok(()));
    assert_eq!(outcome("audit_verify", "unkeyed"), Ok(()));
    // The log is the real server's: its serving certificate, an issue, two
    // denials, signed checkpoints.
    let log = std::fs::read_to_string(dir.join("audit_verify/seed-signed")).unwrap();
    let report = verify_lines(
        &fuzzing::log_lines(&log[1..]),
        Some(&fuzzing::audit_key().verify_key()),
    )
    .unwrap();
    assert_eq!(report.records, 4, "{log}");
    assert!(report.signed_checkpoints >= 2);
    assert_eq!(report.unsigned_tail, 0);
    assert!(log.contains(r#""decision":"allow""#) && log.contains(r#""decision":"deny""#));
}
