//! The PKCS#11 signer in-process against SoftHSM2: concurrent signatures
//! through the session pool, and recovery after the module logs the
//! application out (session recovery) and after the module is finalized
//! under the signer (module recovery). One test: the module is global state
//! of this process, and finalizing it would break a concurrent test.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use aws_lc_rs::signature::{UnparsedPublicKey, ECDSA_P256_SHA256_ASN1, ECDSA_P384_SHA384_ASN1};
use meshca::ca::generate::KeyType;
use meshca::ca::signer::pkcs11::{generate_key, Pkcs11Signer};
use meshca::ca::signer::uri::Pkcs11Uri;
use meshca::ca::signer::{KeyAlgorithm, Signer};

fn module() -> &'static str {
    [
        "/usr/lib/softhsm/libsofthsm2.so",
        "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("SoftHSM2 is not installed (apt-get install softhsm2; scripts/test does this)")
}

fn verify(signer: &dyn Signer, msg: &[u8], sig: &[u8]) {
    let alg = match signer.algorithm() {
        KeyAlgorithm::EcdsaP256 => &ECDSA_P256_SHA256_ASN1,
        KeyAlgorithm::EcdsaP384 => &ECDSA_P384_SHA384_ASN1,
        KeyAlgorithm::Rsa => unreachable!(),
    };
    UnparsedPublicKey::new(alg, signer.public_key())
        .verify(msg, sig)
        .expect("signature verifies with the token's public key");
}

/// Runs [`in_own_module`] in a child process whose SOFTHSM2_CONF names a
/// fresh token directory (the module reads it once per process).
#[test]
fn pooled_signing_survives_logout_and_module_finalize() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("tokens")).unwrap();
    let conf = dir.path().join("softhsm2.conf");
    std::fs::write(
        &conf,
        format!(
            "directories.tokendir = {}\nobjectstore.backend = file\nlog.level = ERROR\n",
            dir.path().join("tokens").display()
        ),
    )
    .unwrap();
    std::fs::write(dir.path().join("pin"), "1234\n").unwrap();
    let out = std::process::Command::new("softhsm2-util")
        .env("SOFTHSM2_CONF", &conf)
        .args([
            "--init-token",
            "--free",
            "--label",
            "reconnect",
            "--so-pin",
            "5678",
            "--pin",
            "1234",
        ])
        .output()
        .expect("softhsm2-util is installed (scripts/test installs softhsm2)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (code, text) = meshca::testing::output_text(
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "in_own_module", "--ignored", "--nocapture"])
            .env("SOFTHSM2_CONF", &conf)
            .env("RECONNECT_PIN_FILE", dir.path().join("pin")),
    );
    assert!(code == 0 && text.contains("1 passed"), "{text}");
}

#[test]
#[ignore = "run by pooled_signing_survives_logout_and_module_finalize with its own SOFTHSM2_CONF"]
fn in_own_module() {
    let pin = std::env::var("RECONNECT_PIN_FILE").expect("started by the outer test");
    let uri: Pkcs11Uri = format!(
        "pkcs11:token=reconnect;object=k?module-path={}&pin-source=file:{}",
        module(),
        pin
    )
    .parse()
    .unwrap();
    generate_key(&uri, KeyType::EcdsaP384).unwrap();
    // A second key with the same label is refused, not made.
    assert_eq!(
        generate_key(&uri, KeyType::EcdsaP384).unwrap_err().reason(),
        "signer_key_ambiguous"
    );
    let signer = Arc::new(Pkcs11Signer::open(&uri, 3).unwrap());
    assert_eq!(signer.algorithm(), KeyAlgorithm::EcdsaP384);

    // 8 threads through a pool of 3 sessions.
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let s = signer.clone();
            std::thread::spawn(move || {
                for i in 0..25 {
                    let msg = format!("tbs {t} {i}");
                    let sig = s.sign(msg.as_bytes()).unwrap();
                    verify(s.as_ref(), msg.as_bytes(), &sig);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(signer.reconnects(), 0);

    // Another handle on the same module logs the application out: every
    // pooled session loses its login (CKR_USER_NOT_LOGGED_IN).
    {
        let ctx = signer.context().unwrap();
        let (slot, _) = meshca::ca::signer::pkcs11::find_slot(&ctx, &uri).unwrap();
        let s = ctx.open_ro_session(slot).unwrap();
        s.logout().unwrap();
    }
    let sig = signer.sign(b"after logout").unwrap();
    verify(signer.as_ref(), b"after logout", &sig);
    // SoftHSM2 hides a private key from a logged-out application
    // (CKR_KEY_HANDLE_INVALID), which calls for finding the key again: one
    // connection rebuild, with a new login.
    let after_logout = signer.reconnects();
    assert!(after_logout <= 1, "{after_logout} reconnects");

    // The module is finalized under the signer (CKR_CRYPTOKI_NOT_INITIALIZED).
    signer.context().unwrap().finalize().unwrap();
    let sig = signer.sign(b"after finalize").unwrap();
    verify(signer.as_ref(), b"after finalize", &sig);
    assert_eq!(signer.reconnects(), after_logout + 1);
    // And the pool still serves concurrent callers on the new connection.
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let s = signer.clone();
            std::thread::spawn(move || {
                let msg = format!("after {t}");
                verify(s.as_ref(), msg.as_bytes(), &s.sign(msg.as_bytes()).unwrap());
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(signer.reconnects(), after_logout + 1);
}
