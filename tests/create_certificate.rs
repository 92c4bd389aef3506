//! End-to-end tests of CreateCertificate: a real server on 127.0.0.1:0 with
//! real rustls handshakes, driven by a tonic client.
#![allow(clippy::unwrap_used, clippy::type_complexity)]

use std::time::Duration;

use meshca::app::Deps;
use meshca::audit::Decision;
use meshca::ca::generate::KeyType;
use meshca::ca::{chain::split_elements, CaBundle};
use meshca::testing::{
    self, client, client_identity, csr_for, csr_pem, request, string_value, validity_hours, TestPki,
};
use rcgen::{CertificateParams, KeyPair, SanType};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, UnixTime};
use time::OffsetDateTime;
use tonic::Code;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::{FromDer, X509Certificate};

const CLIENT_ID: &str = "spiffe://cluster.local/ns/default/sa/client";

fn bundle(pki: &TestPki) -> CaBundle {
    CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap()
}

fn der(pem: &str) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}

/// Independent verification with webpki against the root only.
fn verify_with_webpki(chain: &[String], root_pem: &str) {
    let root = der(root_pem);
    let anchors = vec![webpki::anchor_from_trusted_cert(&root).unwrap()];
    let leaf = der(&chain[0]);
    let intermediates: Vec<_> = chain[1..chain.len() - 1].iter().map(|p| der(p)).collect();
    let ee = webpki::EndEntityCert::try_from(&leaf).unwrap();
    for usage in [
        webpki::KeyUsage::client_auth(),
        webpki::KeyUsage::server_auth(),
    ] {
        ee.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            &intermediates,
            UnixTime::now(),
            usage,
            None,
            None,
        )
        .expect("leaf chains to the root");
    }
}

#[tokio::test]
async fn issued_leaf_matches_istiod_profile_and_chain_layout() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let b = bundle(&pki);
    // Renewal jitter off: the validity is then istiod's exactly.
    let mut cfg = testing::test_config(pki.path_buf());
    cfg.ttl.jitter = None;
    let (app, audit) = testing::start_server(&cfg, Deps::default()).await;
    let (cert, key) = client_identity(&b, CLIENT_ID, &validity_hours(-1, 1));
    let mut c = client(app.addr, &pki.ca.root_cert, Some((&cert, &key)))
        .await
        .unwrap();

    let leaf_key = KeyPair::generate().unwrap();
    let before = OffsetDateTime::now_utc();
    let resp = c
        .create_certificate(request(csr_for(&leaf_key, CLIENT_ID), 3600, &[]))
        .await
        .unwrap()
        .into_inner();
    let chain = resp.cert_chain;

    // Layout: [leaf, each cert of cert-chain.pem, root-cert.pem verbatim].
    assert_eq!(
        chain.len(),
        4,
        "leaf + intermediate + root (from cert-chain.pem) + root bundle"
    );
    assert_eq!(chain[1..3], split_elements(&pki.ca.cert_chain())[..]);
    assert_eq!(chain[1], pki.ca.ca_cert);
    assert_eq!(chain[3], pki.ca.root_cert);
    for el in &chain {
        assert!(
            el.ends_with("-----\n") && !el.ends_with("\n\n") && !el.contains('\r'),
            "one trailing newline: {el:?}"
        );
    }
    verify_with_webpki(&chain, &pki.ca.root_cert);

    let leaf_der = der(&chain[0]);
    let (_, leaf) = X509Certificate::from_der(&leaf_der).unwrap();
    assert!(
        leaf.subject().iter_attributes().next().is_none(),
        "empty subject"
    );
    assert!(
        leaf.raw_serial().len() >= 15 && leaf.raw_serial().len() <= 17,
        "128-bit serial"
    );
    assert_eq!(
        leaf.public_key().raw,
        rcgen::PublicKeyData::subject_public_key_info(&leaf_key).as_slice(),
        "CSR public key"
    );
    let nb = leaf.validity().not_before.to_datetime();
    let na = leaf.validity().not_after.to_datetime();
    assert_eq!(
        na - nb,
        time::Duration::seconds(3600 + 120),
        "jitter off: TTL + 2 minute backdate, as istiod"
    );
    assert!((nb - (before - time::Duration::minutes(2))).abs() < time::Duration::seconds(5));

    let mut seen = Vec::new();
    for ext in leaf.extensions() {
        match ext.parsed_extension() {
            ParsedExtension::SubjectAlternativeName(san) => {
                assert!(ext.critical, "SAN critical");
                assert_eq!(san.general_names, vec![GeneralName::URI(CLIENT_ID)]);
                seen.push("san");
            }
            ParsedExtension::KeyUsage(ku) => {
                assert!(ext.critical);
                assert!(ku.digital_signature() && ku.key_encipherment());
                assert!(!ku.key_cert_sign() && !ku.crl_sign());
                seen.push("ku");
            }
            ParsedExtension::ExtendedKeyUsage(eku) => {
                assert!(eku.server_auth && eku.client_auth && eku.other.is_empty());
                seen.push("eku");
            }
            ParsedExtension::BasicConstraints(bc) => {
                assert!(ext.critical && !bc.ca);
                seen.push("bc");
            }
            ParsedExtension::AuthorityKeyIdentifier(aki) => {
                assert_eq!(
                    hex::encode(aki.key_identifier.as_ref().unwrap().0),
                    b.key_id()
                );
                seen.push("aki");
            }
            other => panic!("unexpected extension {other:?}"),
        }
    }
    seen.sort();
    assert_eq!(seen, ["aki", "bc", "eku", "ku", "san"]);

    // Exactly one audit record, allow, with the issued serial.
    let records = audit.requests();
    assert_eq!(records.len(), 1);
    let r = &records[0];
    assert_eq!(r.decision, Decision::Allow);
    assert_eq!(r.authn_method.as_deref(), Some("mtls"));
    assert_eq!(r.caller_identity.as_deref(), Some(CLIENT_ID));
    assert_eq!(
        r.serial
            .as_deref()
            .map(|s| s.trim_start_matches('0').to_string()),
        Some(
            hex::encode(leaf.raw_serial())
                .trim_start_matches('0')
                .to_string()
        )
    );
    assert_eq!(r.issuer_key_id.as_deref(), Some(b.key_id()));
    app.shutdown().await.unwrap();
}

/// Renewal storms: leaves issued in one burst through the real server must
/// not share one lifetime (ztunnel renews at exactly the written midpoint),
/// and each audit record says how its lifetime was chosen.
#[tokio::test]
async fn a_burst_of_leaves_gets_lifetimes_spread_over_the_band() {
    const N: usize = 300;
    let pki = TestPki::new(KeyType::EcdsaP256);
    let b = bundle(&pki);
    let (app, audit) =
        testing::start_server(&testing::test_config(pki.path_buf()), Deps::default()).await;
    let (cert, key) = client_identity(&b, CLIENT_ID, &validity_hours(-1, 1));
    let c = client(app.addr, &pki.ca.root_cert, Some((&cert, &key)))
        .await
        .unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let csr = csr_for(&leaf_key, CLIENT_ID);
    let calls = (0..N).map(|_| {
        let (mut c, csr) = (c.clone(), csr.clone());
        tokio::spawn(async move {
            let before = OffsetDateTime::now_utc().unix_timestamp();
            let chain = c
                .create_certificate(request(csr, 3600, &[]))
                .await
                .unwrap()
                .into_inner()
                .cert_chain;
            let leaf_der = der(&chain[0]);
            let (_, leaf) = X509Certificate::from_der(&leaf_der).unwrap();
            let (nb, na) = (
                leaf.validity().not_before.timestamp(),
                leaf.validity().not_after.timestamp(),
            );
            let after = OffsetDateTime::now_utc().unix_timestamp();
            (before..=after, nb, na, hex::encode(leaf.raw_serial()))
        })
    });
    let leaves: Vec<_> = futures::future::join_all(calls)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let records = audit.requests();
    let mut quarters = [0usize; 4];
    let mut lifetimes = std::collections::HashSet::new();
    for (call, nb, na, serial) in &leaves {
        assert!(
            call.contains(&(nb + 120)),
            "2 minute backdate from issuance"
        );
        let life = na - nb - 120;
        assert!(
            (3240..=3600).contains(&life),
            "lifetime {life} outside 90-100%"
        );
        quarters[((life - 3240) * 4 / 361) as usize] += 1;
        lifetimes.insert(life);
        let r = records
            .iter()
            .find(|r| {
                r.serial.as_deref().map(|s| s.trim_start_matches('0'))
                    == Some(serial.trim_start_matches('0'))
            })
            .expect("audit record of the leaf");
        let choice = r.lifetime.expect("lifetime choice audited");
        assert_eq!(choice.granted_secs, 3600);
        assert_eq!(choice.band, Some(meshca::ca::ttl::JitterBand::DEFAULT));
        assert_eq!(choice.lifetime_secs as i64, life);
        assert_eq!(choice.backdate_secs, 120);
    }
    // Uniform over 361 values: 300 draws leave each quarter with 75 +- 7.5 expected.
    assert!(quarters.iter().all(|q| *q >= 40), "quarters {quarters:?}");
    assert!(
        lifetimes.len() >= 150,
        "{} distinct lifetimes",
        lifetimes.len()
    );
    let json = serde_json::to_value(&records[0]).unwrap();
    assert_eq!(json["lifetime"]["band"]["min_percent"], 90, "{json}");
    app.shutdown().await.unwrap();
}

#[tokio::test]
async fn mtls_renewal_returns_the_same_identity() {
    let pki = TestPki::new(KeyType::EcdsaP384);
    let b = bundle(&pki);
    let (app, _audit) =
        testing::start_server(&testing::test_config(pki.path_buf()), Deps::default()).await;
    let (mut cert, mut key) = client_identity(&b, CLIENT_ID, &validity_hours(-1, 1));
    for _ in 0..3 {
        let mut c = client(app.addr, &pki.ca.root_cert, Some((&cert, &key)))
            .await
            .unwrap();
        let new_key = KeyPair::generate().unwrap();
        let chain = c
            .create_certificate(request(csr_for(&new_key, CLIENT_ID), 0, &[]))
            .await
            .unwrap()
            .into_inner()
            .cert_chain;
        let leaf_der = der(&chain[0]);
        let (_, leaf) = X509Certificate::from_der(&leaf_der).unwrap();
        let uris: Vec<String> = leaf
            .subject_alternative_name()
            .unwrap()
            .unwrap()
            .value
            .general_names
            .iter()
            .map(|g| format!("{g}"))
            .collect();
        assert_eq!(uris, vec![format!("URI({CLIENT_ID})")]);
        let life =
            leaf.validity().not_after.to_datetime() - leaf.validity().not_before.to_datetime();
        // Default TTL, jitter on by default: 90-100% of 24h, plus the 2 minute backdate.
        let band = (time::Duration::hours(24) * 0.9)..=time::Duration::hours(24);
        assert!(
            band.contains(&(life - time::Duration::minutes(2))),
            "default TTL within the jitter band: {life}"
        );
        // Renew with what we were just given.
        cert = chain[..chain.len() - 1].concat();
        key = new_key.serialize_pem();
    }
    app.shutdown().await.unwrap();
}

#[tokio::test]
async fn rsa_ca_and_multi_intermediate_chain_are_byte_exact() {
    let pki = TestPki::new(KeyType::Rsa2048);
    // Two blocks separated by a blank line, as in istiod's multi-cert test.
    let chain_text = format!("{}\n{}", pki.ca.ca_cert, pki.ca.root_cert);
    std::fs::write(pki.path().join("cert-chain.pem"), &chain_text).unwrap();
    let b = bundle(&pki);
    let (app, _) =
        testing::start_server(&testing::test_config(pki.path_buf()), Deps::default()).await;
    let (cert, key) = client_identity(&b, CLIENT_ID, &validity_hours(-1, 1));
    let mut c = client(app.addr, &pki.ca.root_cert, Some((&cert, &key)))
        .await
        .unwrap();
    let k = KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, rcgen::RsaKeySize::_2048).unwrap();
    let chain = c
        .create_certificate(request(csr_for(&k, CLIENT_ID), 600, &[]))
        .await
        .unwrap()
        .into_inner()
        .cert_chain;
    assert_eq!(
        chain[1..],
        [
            pki.ca.ca_cert.clone(),
            pki.ca.root_cert.clone(),
            pki.ca.root_cert.clone()
        ]
    );
    verify_with_webpki(&chain, &pki.ca.root_cert);
    app.shutdown().await.unwrap();
}

#[tokio::test]
async fn kubernetes_tls_secret_layout_is_served() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tls.crt"), &pki.ca.ca_cert).unwrap();
    meshca::ca::generate::write_file(&dir.path().join("tls.key"), pki.ca.ca_key.as_bytes(), true)
        .unwrap();
    std::fs::write(dir.path().join("ca.crt"), &pki.ca.root_cert).unwrap();
    let b = CaBundle::load_dir(dir.path(), OffsetDateTime::now_utc()).unwrap();
    let (app, _) = testing::start_server(
        &testing::test_config(dir.path().to_path_buf()),
        Deps::default(),
    )
    .await;
    let (cert, key) = client_identity(&b, CLIENT_ID, &validity_hours(-1, 1));
    let mut c = client(app.addr, &pki.ca.root_cert, Some((&cert, &key)))
        .await
        .unwrap();
    let chain = c
        .create_certificate(request(
            csr_for(&KeyPair::generate().unwrap(), CLIENT_ID),
            0,
            &[],
        ))
        .await
        .unwrap()
        .into_inner()
        .cert_chain;
    // istiod: chain = tls.crt + ca.crt, then the root bundle (ca.crt).
    assert_eq!(
        chain[1..],
        [
            pki.ca.ca_cert.clone(),
            pki.ca.root_cert.clone(),
            pki.ca.root_cert.clone()
        ]
    );
    verify_with_webpki(&chain, &pki.ca.root_cert);
    app.shutdown().await.unwrap();
}

#[test]
fn partial_bundle_names_the_missing_files() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    std::fs::remove_file(pki.path().join("cert-chain.pem")).unwrap();
    std::fs::remove_file(pki.path().join("ca-key.pem")).unwrap();
    let err = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ca-key.pem") && err.contains("cert-chain.pem") && err.contains("incomplete"),
        "{err}"
    );
}

#[test]
fn mismatched_key_and_foreign_root_are_refused() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let other = TestPki::new(KeyType::EcdsaP256);
    std::fs::write(pki.path().join("ca-key.pem"), &other.ca.ca_key).unwrap();
    let err = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap_err();
    assert_eq!(err.reason(), "ca_key_mismatch");
    std::fs::write(pki.path().join("ca-key.pem"), &pki.ca.ca_key).unwrap();
    std::fs::write(pki.path().join("root-cert.pem"), &other.ca.root_cert).unwrap();
    let err = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap_err();
    assert_eq!(err.reason(), "ca_chain_invalid", "{err}");
}

/// What a bad-input case is expected to produce.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Want {
    Code(Code),
    /// Rejected in the TLS handshake: the call fails before reaching the service.
    HandshakeRejected,
}

#[tokio::test]
async fn bad_inputs_get_stable_codes_and_one_audit_record_each() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let b = bundle(&pki);
    let foreign = TestPki::new(KeyType::EcdsaP256);
    let fb = bundle(&foreign);
    let cfg = testing::test_config(pki.path_buf());
    let (app, audit) = testing::start_server(&cfg, Deps::default()).await;
    let good = client_identity(&b, CLIENT_ID, &validity_hours(-1, 1));

    let key = KeyPair::generate().unwrap();
    let good_csr = csr_for(&key, CLIENT_ID);
    let cert_pem = pki.ca.ca_cert.clone();
    let uri = |s: &str| SanType::URI(s.to_string().try_into().unwrap());
    let mut tampered =
        rustls_pki_types::CertificateSigningRequestDer::from_pem_slice(good_csr.as_bytes())
            .unwrap()
            .as_ref()
            .to_vec();
    let n = tampered.len();
    tampered[n - 3] ^= 0x55;
    let fixture = |name: &str| {
        std::fs::read_to_string(format!(
            "{}/tests/fixtures/{name}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap()
    };
    let num = |n: f64| prost_types::Value {
        kind: Some(prost_types::value::Kind::NumberValue(n)),
    };
    let boolean = |v: bool| prost_types::Value {
        kind: Some(prost_types::value::Kind::BoolValue(v)),
    };
    let list = prost_types::Value {
        kind: Some(prost_types::value::Kind::ListValue(
            prost_types::ListValue {
                values: vec![string_value("x")],
            },
        )),
    };

    // Client certificates meshca must refuse in the handshake.
    let expired = client_identity(&b, CLIENT_ID, &validity_hours(-3, -1));
    let foreign_ca = client_identity(&fb, CLIENT_ID, &validity_hours(-1, 1));
    let foreign_td = client_identity(
        &b,
        "spiffe://other.domain/ns/default/sa/client",
        &validity_hours(-1, 1),
    );
    let custom = |sans: Vec<SanType>| {
        let k = KeyPair::generate().unwrap();
        let mut p = CertificateParams::default();
        p.subject_alt_names = sans;
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        (testing::sign_custom(&b, &p, &k), k.serialize_pem())
    };
    let dns_only = custom(vec![SanType::DnsName("client.example".try_into().unwrap())]);
    let two_uris = custom(vec![
        uri(CLIENT_ID),
        uri("spiffe://cluster.local/ns/default/sa/other"),
    ]);
    let not_spiffe = custom(vec![uri("https://example.com/client")]);

    let max = 90 * 24 * 3600;
    type Ident<'a> = Option<&'a (String, String)>;
    let cases: Vec<(
        &str,
        Ident<'_>,
        Option<&str>,
        meshca::proto::IstioCertificateRequest,
        Want,
        Option<&str>,
    )> = vec![
        (
            "empty csr",
            Some(&good),
            None,
            request(String::new(), 0, &[]),
            Want::Code(Code::InvalidArgument),
            Some("csr_not_pem"),
        ),
        (
            "garbage csr",
            Some(&good),
            None,
            request("hello".into(), 0, &[]),
            Want::Code(Code::InvalidArgument),
            Some("csr_not_pem"),
        ),
        (
            "certificate instead of csr",
            Some(&good),
            None,
            request(cert_pem.clone(), 0, &[]),
            Want::Code(Code::InvalidArgument),
            Some("csr_not_pem"),
        ),
        (
            "bad base64 body",
            Some(&good),
            None,
            request(
                "-----BEGIN CERTIFICATE REQUEST-----\n!!!!\n-----END CERTIFICATE REQUEST-----\n"
                    .into(),
                0,
                &[],
            ),
            Want::Code(Code::InvalidArgument),
            Some("csr_not_pem"),
        ),
        (
            "truncated der",
            Some(&good),
            None,
            request(
                testing::pem_encode("CERTIFICATE REQUEST", &tampered[..n / 2]),
                0,
                &[],
            ),
            Want::Code(Code::InvalidArgument),
            Some("csr_malformed"),
        ),
        (
            "oversized csr",
            Some(&good),
            None,
            request(format!("{good_csr}{}", "A".repeat(70 * 1024)), 0, &[]),
            Want::Code(Code::InvalidArgument),
            Some("csr_too_large"),
        ),
        (
            "bad signature",
            Some(&good),
            None,
            request(
                testing::pem_encode("CERTIFICATE REQUEST", &tampered),
                0,
                &[],
            ),
            Want::Code(Code::InvalidArgument),
            Some("csr_bad_signature"),
        ),
        (
            "rsa 1024 key",
            Some(&good),
            None,
            request(fixture("rsa1024.csr"), 0, &[]),
            Want::Code(Code::InvalidArgument),
            Some("csr_rsa_key_size"),
        ),
        (
            "sha1 signature",
            Some(&good),
            None,
            request(fixture("rsa-sha1.csr"), 0, &[]),
            Want::Code(Code::InvalidArgument),
            Some("csr_unsupported_signature_algorithm"),
        ),
        (
            "dsa key",
            Some(&good),
            None,
            request(fixture("dsa.csr"), 0, &[]),
            Want::Code(Code::InvalidArgument),
            Some("csr_unsupported_key_type"),
        ),
        (
            "p521 key",
            Some(&good),
            None,
            request(
                csr_for(
                    &KeyPair::generate_for(&rcgen::PKCS_ECDSA_P521_SHA512).unwrap(),
                    CLIENT_ID,
                ),
                0,
                &[],
            ),
            Want::Code(Code::InvalidArgument),
            Some("csr_unsupported_key_type"),
        ),
        (
            "dns san",
            Some(&good),
            None,
            request(
                csr_pem(
                    &key,
                    &[SanType::DnsName("evil.example".try_into().unwrap())],
                    false,
                ),
                0,
                &[],
            ),
            Want::Code(Code::InvalidArgument),
            Some("csr_san_not_authorized"),
        ),
        (
            "ip san",
            Some(&good),
            None,
            request(
                csr_pem(
                    &key,
                    &[SanType::IpAddress("10.0.0.1".parse().unwrap())],
                    false,
                ),
                0,
                &[],
            ),
            Want::Code(Code::InvalidArgument),
            Some("csr_san_not_authorized"),
        ),
        (
            "other identity",
            Some(&good),
            None,
            request(
                csr_for(&key, "spiffe://cluster.local/ns/kube-system/sa/admin"),
                0,
                &[],
            ),
            Want::Code(Code::InvalidArgument),
            Some("csr_san_not_authorized"),
        ),
        (
            "own plus other uri",
            Some(&good),
            None,
            request(
                csr_pem(
                    &key,
                    &[uri(CLIENT_ID), uri("spiffe://cluster.local/ns/a/sa/b")],
                    false,
                ),
                0,
                &[],
            ),
            Want::Code(Code::InvalidArgument),
            Some("csr_san_not_authorized"),
        ),
        (
            "csr asks for ca",
            Some(&good),
            None,
            request(csr_pem(&key, &[uri(CLIENT_ID)], true), 0, &[]),
            Want::Code(Code::InvalidArgument),
            Some("csr_requests_ca"),
        ),
        (
            "ttl zero uses default",
            Some(&good),
            None,
            request(good_csr.clone(), 0, &[]),
            Want::Code(Code::Ok),
            None,
        ),
        (
            "ttl negative uses default",
            Some(&good),
            None,
            request(good_csr.clone(), -1, &[]),
            Want::Code(Code::Ok),
            None,
        ),
        (
            "ttl i64 min uses default",
            Some(&good),
            None,
            request(good_csr.clone(), i64::MIN, &[]),
            Want::Code(Code::Ok),
            None,
        ),
        (
            "ttl exactly max",
            Some(&good),
            None,
            request(good_csr.clone(), max, &[]),
            Want::Code(Code::Ok),
            None,
        ),
        (
            "ttl max plus one",
            Some(&good),
            None,
            request(good_csr.clone(), max + 1, &[]),
            Want::Code(Code::InvalidArgument),
            Some("ttl_too_long"),
        ),
        (
            "ttl huge",
            Some(&good),
            None,
            request(good_csr.clone(), 9_300_000_000, &[]),
            Want::Code(Code::InvalidArgument),
            Some("ttl_too_long"),
        ),
        (
            "ttl overflowing",
            Some(&good),
            None,
            request(good_csr.clone(), i64::MAX, &[]),
            Want::Code(Code::InvalidArgument),
            Some("ttl_too_long"),
        ),
        (
            "no client cert no token",
            None,
            None,
            request(good_csr.clone(), 0, &[]),
            Want::Code(Code::Unauthenticated),
            Some("authn_no_credentials"),
        ),
        (
            "token without token authenticator",
            None,
            Some("Bearer abc.def.ghi"),
            request(good_csr.clone(), 0, &[]),
            Want::Code(Code::Unauthenticated),
            Some("authn_token_disabled"),
        ),
        (
            "non-bearer authorization",
            None,
            Some("Basic callername"),
            request(good_csr.clone(), 0, &[]),
            Want::Code(Code::Unauthenticated),
            Some("authn_no_credentials"),
        ),
        (
            "bad auth beats bad csr",
            None,
            None,
            request("garbage".into(), 0, &[]),
            Want::Code(Code::Unauthenticated),
            Some("authn_no_credentials"),
        ),
        (
            "expired client cert",
            Some(&expired),
            None,
            request(good_csr.clone(), 0, &[]),
            Want::HandshakeRejected,
            None,
        ),
        (
            "client cert from foreign ca",
            Some(&foreign_ca),
            None,
            request(good_csr.clone(), 0, &[]),
            Want::HandshakeRejected,
            None,
        ),
        (
            "client cert in foreign trust domain",
            Some(&foreign_td),
            None,
            request(good_csr.clone(), 0, &[]),
            Want::HandshakeRejected,
            None,
        ),
        (
            "client cert without uri san",
            Some(&dns_only),
            None,
            request(good_csr.clone(), 0, &[]),
            Want::HandshakeRejected,
            None,
        ),
        (
            "client cert with two uri sans",
            Some(&two_uris),
            None,
            request(good_csr.clone(), 0, &[]),
            Want::HandshakeRejected,
            None,
        ),
        (
            "client cert with non-spiffe uri",
            Some(&not_spiffe),
            None,
            request(good_csr.clone(), 0, &[]),
            Want::HandshakeRejected,
            None,
        ),
        (
            "impersonation as number",
            Some(&good),
            None,
            request(good_csr.clone(), 0, &[("ImpersonatedIdentity", num(1.0))]),
            Want::Code(Code::InvalidArgument),
            Some("metadata_wrong_type"),
        ),
        (
            "impersonation as list",
            Some(&good),
            None,
            request(
                good_csr.clone(),
                0,
                &[("ImpersonatedIdentity", list.clone())],
            ),
            Want::Code(Code::InvalidArgument),
            Some("metadata_wrong_type"),
        ),
        (
            "cert signer as bool",
            Some(&good),
            None,
            request(good_csr.clone(), 0, &[("CertSigner", boolean(true))]),
            Want::Code(Code::InvalidArgument),
            Some("metadata_wrong_type"),
        ),
        (
            "empty impersonation is absent",
            Some(&good),
            None,
            request(
                good_csr.clone(),
                0,
                &[
                    ("ImpersonatedIdentity", string_value("")),
                    ("CertSigner", string_value("")),
                ],
            ),
            Want::Code(Code::Ok),
            None,
        ),
        (
            "impersonation without node authorizer",
            Some(&good),
            None,
            request(
                csr_for(&key, "spiffe://cluster.local/ns/a/sa/b"),
                0,
                &[(
                    "ImpersonatedIdentity",
                    string_value("spiffe://cluster.local/ns/a/sa/b"),
                )],
            ),
            Want::Code(Code::Unauthenticated),
            Some("impersonation_not_configured"),
        ),
    ];
    assert!(cases.len() >= 25);

    for (name, ident, auth, req, want, reason) in cases {
        let before = audit.requests().len();
        let got = async {
            let mut c = client(
                app.addr,
                &pki.ca.root_cert,
                ident.map(|(c, k)| (c.as_str(), k.as_str())),
            )
            .await
            .map_err(|e| format!("connect: {e}"))?;
            let mut r = tonic::Request::new(req);
            if let Some(a) = auth {
                r.metadata_mut().insert("authorization", a.parse().unwrap());
            }
            c.create_certificate(r)
                .await
                .map_err(|s| format!("{:?}|{}", s.code(), s.message()))
        }
        .await;
        let records = audit.requests();
        match want {
            Want::Code(Code::Ok) => {
                let resp = got.unwrap_or_else(|e| panic!("{name}: expected OK, got {e}"));
                assert_eq!(resp.into_inner().cert_chain.len(), 4, "{name}");
                assert_eq!(records.len(), before + 1, "{name}: one audit record");
                assert_eq!(records[before].decision, Decision::Allow, "{name}");
            }
            Want::Code(code) => {
                let err = got
                    .err()
                    .unwrap_or_else(|| panic!("{name}: expected {code:?}, got OK"));
                assert!(
                    err.starts_with(&format!("{code:?}|")),
                    "{name}: expected {code:?}, got {err}"
                );
                if code == Code::Unauthenticated {
                    // Opaque to the client, as istiod.
                    assert!(
                        err.ends_with("|request authenticate failure")
                            || err.ends_with("|request impersonation authentication failure"),
                        "{name}: {err}"
                    );
                }
                assert_eq!(records.len(), before + 1, "{name}: one audit record");
                assert_eq!(records[before].decision, Decision::Deny, "{name}");
                assert_eq!(Some(records[before].reason.as_str()), reason, "{name}");
            }
            Want::HandshakeRejected => {
                let err = got
                    .err()
                    .unwrap_or_else(|| panic!("{name}: expected handshake failure, got OK"));
                assert!(
                    err.starts_with("connect:")
                        || err.starts_with("Unavailable|")
                        || err.starts_with("Unknown|"),
                    "{name}: {err}"
                );
                assert_eq!(records.len(), before, "{name}: never reached the service");
            }
        }
    }

    // Still serving after all of that.
    let mut c = client(app.addr, &pki.ca.root_cert, Some((&good.0, &good.1)))
        .await
        .unwrap();
    c.create_certificate(request(good_csr, 0, &[]))
        .await
        .unwrap();
    app.shutdown().await.unwrap();
}

#[tokio::test]
async fn istiod_csr_policy_ignores_csr_sans() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let b = bundle(&pki);
    let mut cfg = testing::test_config(pki.path_buf());
    cfg.csr_policy = meshca::ca::CsrPolicy::Istiod;
    let (app, _) = testing::start_server(&cfg, Deps::default()).await;
    let (cert, key) = client_identity(&b, CLIENT_ID, &validity_hours(-1, 1));
    let mut c = client(app.addr, &pki.ca.root_cert, Some((&cert, &key)))
        .await
        .unwrap();
    let k = KeyPair::generate().unwrap();
    let csr = csr_pem(
        &k,
        &[SanType::DnsName("name_in_csr.example".try_into().unwrap())],
        false,
    );
    let chain = c
        .create_certificate(request(csr, 0, &[]))
        .await
        .unwrap()
        .into_inner()
        .cert_chain;
    let leaf_der = der(&chain[0]);
    let (_, leaf) = X509Certificate::from_der(&leaf_der).unwrap();
    let names = &leaf
        .subject_alternative_name()
        .unwrap()
        .unwrap()
        .value
        .general_names;
    assert_eq!(
        names,
        &vec![GeneralName::URI(CLIENT_ID)],
        "SANs are the caller's identity only"
    );
    app.shutdown().await.unwrap();
}

/// Kubernetes Secret volumes swap a `..data` symlink; this lays files out the same way.
fn secret_volume_write(dir: &std::path::Path, generation: u32, files: &[(&str, String)]) {
    let ts = dir.join(format!("..gen_{generation}"));
    std::fs::create_dir(&ts).unwrap();
    for (name, body) in files {
        std::fs::write(ts.join(name), body).unwrap();
        // The chart's Secret volume mode (0440, group = the pod's fsGroup):
        // meshca refuses a key file others can read.
        std::fs::set_permissions(
            ts.join(name),
            std::os::unix::fs::PermissionsExt::from_mode(0o440),
        )
        .unwrap();
    }
    let tmp = dir.join("..data_tmp");
    std::os::unix::fs::symlink(ts.file_name().unwrap(), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    for (name, _) in files {
        let link = dir.join(name);
        if !link.exists() {
            std::os::unix::fs::symlink(format!("..data/{name}"), link).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_reload_swaps_intermediate_without_failing_requests() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let vol = tempfile::tempdir().unwrap();
    let files = |ca: &meshca::ca::generate::GeneratedCa| {
        vec![
            ("ca-cert.pem", ca.ca_cert.clone()),
            ("ca-key.pem", ca.ca_key.clone()),
            ("cert-chain.pem", ca.cert_chain()),
            ("root-cert.pem", ca.root_cert.clone()),
        ]
    };
    secret_volume_write(vol.path(), 1, &files(&pki.ca));
    let old = CaBundle::load_dir(vol.path(), OffsetDateTime::now_utc()).unwrap();
    let mut cfg = testing::test_config(vol.path().to_path_buf());
    // This test is about the reload: with the queue target on, a CPU stall
    // on a shared machine sheds the closed-loop workers' stale requests.
    cfg.admission.queue_target = Duration::ZERO;
    let (app, audit) = testing::start_server(&cfg, Deps::default()).await;
    let (cert, key) = client_identity(&old, CLIENT_ID, &validity_hours(-1, 1));
    let root = pki.ca.root_cert.clone();

    // Load: 4 workers issuing continuously until told to stop.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..4 {
        let (stop, root, cert, key, addr) = (
            stop.clone(),
            root.clone(),
            cert.clone(),
            key.clone(),
            app.addr,
        );
        workers.push(tokio::spawn(async move {
            let mut c = client(addr, &root, Some((&cert, &key))).await.unwrap();
            let (mut ok, mut failed, mut issuers) =
                (0u32, Vec::new(), std::collections::BTreeSet::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let k = KeyPair::generate().unwrap();
                match c
                    .create_certificate(request(csr_for(&k, CLIENT_ID), 0, &[]))
                    .await
                {
                    Ok(r) => {
                        let chain = r.into_inner().cert_chain;
                        verify_with_webpki(&chain, &root);
                        issuers.insert(chain[1].clone());
                        ok += 1;
                    }
                    Err(s) => failed.push(s.to_string()),
                }
            }
            (ok, failed, issuers)
        }));
    }

    tokio::time::sleep(Duration::from_millis(300)).await;
    let new_ca = testing::new_intermediate(&pki.ca, OffsetDateTime::now_utc());
    secret_volume_write(vol.path(), 2, &files(&new_ca));
    // Wait until the new intermediate signs.
    let new_key_id = CaBundle::load_dir(vol.path(), OffsetDateTime::now_utc())
        .unwrap()
        .key_id()
        .to_string();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while app.ca.snapshot().key_id() != new_key_id {
        assert!(
            std::time::Instant::now() < deadline,
            "reload did not happen"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A bad bundle (key of another CA) is rejected; the new one keeps serving.
    let bad = TestPki::new(KeyType::EcdsaP256);
    let mut bad_files = files(&new_ca);
    bad_files[1].1 = bad.ca.ca_key.clone();
    secret_volume_write(vol.path(), 3, &bad_files);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        app.ca.snapshot().key_id(),
        new_key_id,
        "bad bundle rejected"
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);

    let mut total = 0;
    let mut all_issuers = std::collections::BTreeSet::new();
    for w in workers {
        let (ok, failed, issuers) = w.await.unwrap();
        assert!(
            failed.is_empty(),
            "failed requests during reload: {failed:?}"
        );
        total += ok;
        all_issuers.extend(issuers);
    }
    assert!(total > 20, "load actually flowed ({total} requests)");
    assert!(
        all_issuers.contains(&pki.ca.ca_cert) && all_issuers.contains(&new_ca.ca_cert),
        "leaves from both intermediates"
    );
    // New leaves are signed by the new intermediate.
    let records = audit.requests();
    assert_eq!(
        records.last().unwrap().issuer_key_id.as_deref(),
        Some(new_key_id.as_str())
    );
    let mut c = client(app.addr, &root, Some((&cert, &key))).await.unwrap();
    let chain = c
        .create_certificate(request(
            csr_for(&KeyPair::generate().unwrap(), CLIENT_ID),
            0,
            &[],
        ))
        .await
        .unwrap()
        .into_inner()
        .cert_chain;
    assert_eq!(chain[1], new_ca.ca_cert);
    app.shutdown().await.unwrap();
}

#[tokio::test]
async fn metrics_count_a_scripted_mix_and_health_endpoints_answer() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let b = bundle(&pki);
    let (app, audit) =
        testing::start_server(&testing::test_config(pki.path_buf()), Deps::default()).await;
    let (cert, key) = client_identity(&b, CLIENT_ID, &validity_hours(-1, 1));
    let mut mtls = client(app.addr, &pki.ca.root_cert, Some((&cert, &key)))
        .await
        .unwrap();
    let mut anon = client(app.addr, &pki.ca.root_cert, None).await.unwrap();
    let k = KeyPair::generate().unwrap();
    // 3 issued, 2 unauthenticated, 1 CSR error (parse), 1 policy error, 1 TTL error.
    for _ in 0..3 {
        mtls.create_certificate(request(csr_for(&k, CLIENT_ID), 0, &[]))
            .await
            .unwrap();
    }
    for _ in 0..2 {
        anon.create_certificate(request(csr_for(&k, CLIENT_ID), 0, &[]))
            .await
            .unwrap_err();
    }
    mtls.create_certificate(request("garbage".into(), 0, &[]))
        .await
        .unwrap_err();
    mtls.create_certificate(request(
        csr_for(&k, "spiffe://cluster.local/ns/x/sa/y"),
        0,
        &[],
    ))
    .await
    .unwrap_err();
    mtls.create_certificate(request(csr_for(&k, CLIENT_ID), i64::MAX, &[]))
        .await
        .unwrap_err();
    assert_eq!(audit.requests().len(), 8);

    let (status, text) = testing::http_get(app.admin_addr, "/metrics").await;
    assert_eq!(status, 200);
    let root_end = X509Certificate::from_der(&der(&pki.ca.root_cert))
        .unwrap()
        .1
        .validity()
        .not_after
        .timestamp();
    for want in [
        "citadel_server_csr_count 8".to_string(),
        "citadel_server_success_cert_issuance_count 3".into(),
        "citadel_server_authentication_failure_count 2".into(),
        "citadel_server_csr_sign_err_count{error=\"CSR_ERROR\"} 2".into(),
        "citadel_server_csr_sign_err_count{error=\"TTL_ERROR\"} 1".into(),
        "citadel_server_csr_parsing_err_count 1".into(),
        format!("citadel_server_root_cert_expiry_timestamp {root_end}"),
        "meshca_decisions_total{decision=\"allow\",reason=\"issued\"} 3".into(),
        "meshca_decisions_total{decision=\"deny\",reason=\"authn_no_credentials\"} 2".into(),
        "meshca_decisions_total{decision=\"deny\",reason=\"csr_san_not_authorized\"} 1".into(),
        "meshca_request_duration_seconds_count{decision=\"allow\"} 3".into(),
    ] {
        assert!(
            text.lines().any(|l| l == want),
            "missing {want:?} in\n{text}"
        );
    }
    assert!(text.contains("citadel_server_cert_chain_expiry_seconds "));
    assert_eq!(testing::http_get(app.admin_addr, "/healthz").await.0, 200);
    assert_eq!(
        testing::http_get(app.admin_addr, "/readyz").await,
        (200, "ready\n".to_string())
    );
    app.shutdown().await.unwrap();
}
