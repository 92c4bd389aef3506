//! The denylist's `token-key` entries through the use case, with real
//! signing keys: the signer is found by its signature, whatever the header.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::audit::MemorySink;
use crate::authn::jwks::test_keys::{doc, ec_key, sign, Switch};
use crate::authn::jwks::{IssuerKeys, RefreshPolicy};
use crate::authn::{AuthnMethod, Caller};
use crate::ca::generate::KeyType;
use crate::testing::{client_identity, csr_for, mtls_credentials, validity_hours, TestPki};

/// Accepts every token as app/app-0 through `method`.
#[derive(Debug)]
struct Accepts(AuthnMethod);

#[tonic::async_trait]
impl TokenAuthenticator for Accepts {
    async fn authenticate(&self, _: &str, _: Option<&str>) -> Result<Caller, AuthnError> {
        Ok(Caller {
            method: self.0,
            identity: "spiffe://cluster.local/ns/app/sa/app".parse().unwrap(),
            kube: Some(crate::authn::KubernetesInfo {
                pod_namespace: "app".into(),
                pod_name: "app-0".into(),
                pod_uid: "u1".into(),
                service_account: "app".into(),
                node_name: Some("n1".into()),
                cluster_id: None,
            }),
        })
    }
}

/// A leaked key's token re-signed without `kid` (or under another key's)
/// is refused on every path, found by its signature among the keys the
/// issuer published (also after it dropped the key); while the entry
/// exists a token no known key signed is refused too. `Accepts` takes
/// every token, as a TokenReview (or its cache) accepts a kid-less one.
#[tokio::test]
async fn a_denylisted_key_is_found_by_its_signature_whatever_the_header() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let ca = Arc::new(crate::ca::CaStore::from_dir(pki.path(), false).unwrap());
    let (leaked, good, stranger) = (ec_key("leaked"), ec_key("good"), ec_key("stranger"));
    let src = Switch::new("iss", doc(&[&leaked, &good]));
    let unpaced = RefreshPolicy {
        min_interval: Duration::ZERO,
        ..Default::default()
    };
    let keys = Arc::new(IssuerKeys::new(src.clone(), unpaced));
    assert!(keys.refresh().await);
    // Rotated out after the leak: still recognised.
    src.publish(Some(doc(&[&good])));
    assert!(keys.refresh().await);
    let list = Arc::new(crate::denylist::LiveDenylist::new());
    list.set(
        crate::denylist::Source::File,
        crate::denylist::Denylist::parse("token-key leaked").unwrap(),
    );
    let c = serde_json::json!({"iss": "iss", "sub": "x", "exp": 4_000_000_000i64});
    let me = "spiffe://cluster.local/ns/app/sa/app";
    let (chain, _) = client_identity(&ca.snapshot(), me, &validity_hours(-1, 1));
    let cases = [
        (sign(&leaked, None, &c), Err("denylist_token_key")),
        (sign(&leaked, Some("good"), &c), Err("denylist_token_key")),
        (
            sign(&leaked, Some("unknown"), &c),
            Err("denylist_token_key"),
        ),
        (sign(&good, None, &c), Ok(())),
        (sign(&good, Some("good"), &c), Ok(())),
        (
            sign(&stranger, None, &c),
            Err("denylist_token_key_unknown_signer"),
        ),
        (
            sign(&stranger, Some("good"), &c),
            Err("denylist_token_key_unknown_signer"),
        ),
    ];
    for (token, want) in cases {
        for (signers, m) in [
            (true, AuthnMethod::TokenReview),
            (true, AuthnMethod::TokenLocal),
            (
                true,
                AuthnMethod::TokenReviewAfterLocal("token_local_unknown_kid"),
            ),
            (true, AuthnMethod::Mtls),
            (false, AuthnMethod::TokenReview),
        ] {
            let issuer = CertificateIssuer {
                ca: ca.clone(),
                ttl: TtlPolicy::default(),
                csr_policy: CsrPolicy::Strict,
                tokens: Some(Arc::new(Accepts(m))),
                node_authz: None,
                audit: Arc::new(MemorySink::default()),
                metrics: None,
                admission: None,
                guards: IssueGuards {
                    denylist: Some(list.clone()),
                    signers: signers.then(|| keys.clone() as Arc<dyn authn::TokenSigners>),
                    ..Default::default()
                },
            };
            let mut creds = match m {
                AuthnMethod::Mtls => mtls_credentials(&chain),
                _ => Credentials::default(),
            };
            creds.bearer = Some(token.clone());
            let req = IssueRequest {
                csr: csr_for(&rcgen::KeyPair::generate().unwrap(), me),
                validity_secs: 0,
                impersonate: None,
            };
            let got = issuer
                .issue(&creds, Ok(req))
                .await
                .map(|_| ())
                .map_err(|e| e.reason());
            // Beside a certificate the token authenticates nothing: only
            // a denylisted key's signature refuses; no keys, no signer.
            let want = match (signers, m, want) {
                (true, AuthnMethod::Mtls, Err("denylist_token_key_unknown_signer")) => Ok(()),
                (false, _, _) => Err("denylist_token_key_unknown_signer"),
                _ => want,
            };
            assert_eq!(got, want, "{token} x {m:?} (signers: {signers})");
        }
    }
}
