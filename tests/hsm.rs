//! The CA key in a PKCS#11 token (SoftHSM2): `meshca init --pkcs11`,
//! issuance with the key only in the token, startup and runtime failures,
//! and two-tier rollover under load. Each test runs `meshca` processes
//! against its own SoftHSM2 token directory (SOFTHSM2_CONF). SoftHSM2 and
//! pkcs11-tool must be installed (scripts/test installs them): the tests
//! fail, never skip, without them.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use meshca::testing::{client, csr_for, request, spawn_listening, validity_hours};
use time::OffsetDateTime;

#[path = "common/rotation_check.rs"]
mod rotation_check;

const PIN: &str = "4321";
const BIN: &str = env!("CARGO_BIN_EXE_meshca");

fn module() -> PathBuf {
    let found = [
        "/usr/lib/softhsm/libsofthsm2.so",
        "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so",
        "/usr/lib/aarch64-linux-gnu/softhsm/libsofthsm2.so",
    ]
    .into_iter()
    .map(PathBuf::from)
    .find(|p| p.exists());
    found.unwrap_or_else(|| {
        panic!(
            "SoftHSM2 is not installed (apt-get install softhsm2 opensc; scripts/test does this)"
        )
    })
}

/// A SoftHSM2 token of its own: config, token directory, PIN file.
struct Hsm {
    dir: tempfile::TempDir,
    label: String,
}

impl Hsm {
    fn new(label: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("tokens")).unwrap();
        std::fs::write(
            dir.path().join("softhsm2.conf"),
            format!(
                "directories.tokendir = {}\nobjectstore.backend = file\nlog.level = ERROR\n",
                dir.path().join("tokens").display()
            ),
        )
        .unwrap();
        std::fs::write(dir.path().join("pin"), format!("{PIN}\n")).unwrap();
        let hsm = Self {
            dir,
            label: label.into(),
        };
        let out = hsm
            .tool("softhsm2-util")
            .args(["--init-token", "--free", "--label", label])
            .args(["--so-pin", "87654321", "--pin", PIN])
            .output()
            .unwrap_or_else(|e| {
                panic!("softhsm2-util is not installed ({e}); scripts/test installs softhsm2")
            });
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        hsm
    }

    fn conf(&self) -> PathBuf {
        self.dir.path().join("softhsm2.conf")
    }

    fn tool(&self, name: &str) -> Command {
        let mut c = Command::new(name);
        c.env("SOFTHSM2_CONF", self.conf());
        c
    }

    fn uri(&self, object: &str) -> String {
        format!(
            "pkcs11:token={};object={object}?module-path={}&pin-source=file:{}",
            self.label,
            module().display(),
            self.dir.path().join("pin").display()
        )
    }

    fn meshca(&self) -> Command {
        let mut c = self.tool(BIN);
        c.env_remove("MESHCA_PKCS11_PIN");
        c
    }

    /// `meshca init` of a file root in `root/`, then `meshca init --pkcs11`
    /// of the intermediate in `ca/`, signed by that root.
    fn init(&self, object: &str, key_type: &str) -> (PathBuf, PathBuf) {
        let root = self.dir.path().join("root");
        let ca = self.dir.path().join("ca");
        run(self.meshca().args(["init", "--out"]).arg(&root));
        run(self
            .meshca()
            .args(["init", "--key-type", key_type, "--out"])
            .arg(&ca)
            .args(["--pkcs11", &self.uri(object), "--root-from"])
            .arg(&root));
        (root, ca)
    }

    /// A generation: a file root in `{name}-root/` (`meshca init`) and an
    /// intermediate whose key `meshca init --pkcs11` makes in the token as
    /// `object`, in `{name}/` (certificates and `ca-key.uri`).
    fn generation(&self, name: &str, object: &str) -> (PathBuf, PathBuf) {
        let root = self.dir.path().join(format!("{name}-root"));
        let ca = self.dir.path().join(name);
        run(self.meshca().args(["init", "--out"]).arg(&root));
        run(self
            .meshca()
            .args(["init", "--out"])
            .arg(&ca)
            .args(["--pkcs11", &self.uri(object), "--root-from"])
            .arg(&root));
        (root, ca)
    }

    fn serve(&self, ca: &Path, uri: &str, env: &[(&str, &str)]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(BIN);
        cmd.env("SOFTHSM2_CONF", self.conf())
            .env_remove("MESHCA_PKCS11_PIN")
            .env("MESHCA_KUBERNETES", "off")
            .env("MESHCA_AUDIT_SINK", "file")
            .env("MESHCA_AUDIT_FILE", self.dir.path().join("audit.log"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .arg("--ca-dir")
            .arg(ca)
            .args(["--signer", uri])
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        cmd
    }

    fn audit(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.path().join("audit.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

fn run(c: &mut Command) -> String {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An mTLS client identity signed by the CA directory `ca`'s own key in the
/// token (the one `ca-key.uri` names, else `object`), with `ca`'s root as
/// trust: only a leaf of this deployment's own signing certificates may
/// renew over mTLS (`mtls_foreign_issuer`), so the test signs with the same
/// token key the server uses. SoftHSM2 reads `SOFTHSM2_CONF` once per
/// process, so [`mint_client_identity`] signs in a child process of this
/// test binary pointed at this test's token.
fn client_identity(hsm: &Hsm, ca: &Path, object: &str, id: &str) -> (String, String, String) {
    let out = tempfile::tempdir().unwrap();
    run(hsm
        .tool(std::env::current_exe().unwrap().to_str().unwrap())
        .args(["mint_client_identity", "--exact", "--ignored"])
        .args(["--test-threads=1", "--nocapture"])
        .env("MESHCA_TEST_MINT_OUT", out.path())
        .env("MESHCA_TEST_MINT_CA", ca)
        .env("MESHCA_TEST_MINT_URI", hsm.uri(object))
        .env("MESHCA_TEST_MINT_ID", id));
    let read = |f: &str| std::fs::read_to_string(out.path().join(f)).unwrap();
    (read("cert-chain.pem"), read("key.pem"), read_root(ca))
}

fn read_root(ca: &Path) -> String {
    std::fs::read_to_string(ca.join("root-cert.pem")).unwrap()
}

/// Not a test of its own: the child process [`client_identity`] runs. It
/// loads the CA directory with its key in the token, as `meshca serve
/// --signer` does, and writes a client identity signed by that key.
#[test]
#[ignore = "run by client_identity in a child process"]
fn mint_client_identity() {
    use meshca::ca::custody::{ExternalKeys, KeySource};
    use meshca::ca::signer::uri::Pkcs11Uri;
    let var = |k: &str| std::env::var(k).unwrap();
    let out = PathBuf::from(var("MESHCA_TEST_MINT_OUT"));
    let uri: Pkcs11Uri = var("MESHCA_TEST_MINT_URI").parse().unwrap();
    let keys = KeySource::External(std::sync::Arc::new(ExternalKeys::pkcs11(uri, 1)));
    let bundle = keys
        .load(
            Path::new(&var("MESHCA_TEST_MINT_CA")),
            OffsetDateTime::now_utc(),
        )
        .unwrap();
    assert_eq!(bundle.signer().kind(), "pkcs11");
    let (chain, key) = bundle
        .client_identity(
            &var("MESHCA_TEST_MINT_ID").parse().unwrap(),
            &validity_hours(-1, 1),
        )
        .unwrap();
    std::fs::write(out.join("cert-chain.pem"), chain).unwrap();
    std::fs::write(out.join("key.pem"), key).unwrap();
}

const ID: &str = "spiffe://cluster.local/ns/app/sa/app";

/// Verifies `chain` (leaf, intermediates..., root bundle) with openssl at `at`.
fn openssl_verify(chain: &[String], at: i64) {
    let dir = tempfile::tempdir().unwrap();
    let (leaf, rest) = chain.split_first().unwrap();
    let (root, inter) = rest.split_last().unwrap();
    std::fs::write(dir.path().join("leaf.pem"), leaf).unwrap();
    std::fs::write(dir.path().join("inter.pem"), inter.concat()).unwrap();
    std::fs::write(dir.path().join("root.pem"), root).unwrap();
    let out = Command::new("openssl")
        .current_dir(dir.path())
        .args(["verify", "-attime", &at.to_string(), "-CAfile", "root.pem"])
        .args(["-untrusted", "inter.pem", "leaf.pem"])
        .output()
        .expect("openssl is installed");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("leaf.pem: OK"),
        "openssl verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every file under `dir`, recursively.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push(p);
        }
    }
    out
}

async fn issue(
    addr: std::net::SocketAddr,
    ident: &(String, String, String),
) -> Result<Vec<String>, tonic::Status> {
    let mut c = client(addr, &ident.2, Some((&ident.0, &ident.1)))
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let csr = csr_for(&rcgen::KeyPair::generate().unwrap(), ID);
    c.create_certificate(request(csr, 3600, &[]))
        .await
        .map(|r| r.into_inner().cert_chain)
}

#[test_case::test_case("ecdsa-p256", "off" ; "p256 direct")]
#[test_case::test_case("ecdsa-p384", "off" ; "p384 direct")]
#[test_case::test_case("rsa2048", "off" ; "rsa direct")]
#[test_case::test_case("ecdsa-p256", "auto" ; "p256 two tier")]
#[tokio::test(flavor = "multi_thread")]
async fn issuance_with_the_ca_key_only_in_the_token(key_type: &str, issuing: &str) {
    let hsm = Hsm::new("meshca");
    let (_, ca) = hsm.init("intermediate", key_type);
    // The CA directory holds certificates only; the key never left the token.
    let mut names: Vec<_> = std::fs::read_dir(&ca)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "ca-cert.pem",
            "ca-key.uri",
            "cert-chain.pem",
            "root-cert.pem"
        ]
    );
    assert_eq!(
        std::fs::read_to_string(ca.join("ca-key.uri")).unwrap(),
        "pkcs11:object=intermediate\n",
        "the directory names its key in the token, nothing more"
    );
    let objects = run(hsm
        .tool("pkcs11-tool")
        .args(["--module"])
        .arg(module())
        .args([
            "--token-label",
            "meshca",
            "--login",
            "--pin",
            PIN,
            "--list-objects",
        ]));
    let private = objects
        .split("Private Key Object")
        .nth(1)
        .unwrap_or_else(|| panic!("no private key in the token: {objects}"));
    assert!(
        private.contains("never extractable") && private.contains("always sensitive"),
        "{objects}"
    );

    let (mut child, addr, _) = spawn_listening(hsm.serve(
        &ca,
        &hsm.uri("intermediate"),
        &[("MESHCA_ISSUING_CA", issuing)],
    ))
    .await;
    let ident = client_identity(&hsm, &ca, "intermediate", ID);
    let chain = issue(addr, &ident).await.expect("issued");
    let two_tier = issuing != "off";
    // [leaf, (issuing CA,) intermediate, root from cert-chain.pem, root bundle]
    assert_eq!(chain.len(), if two_tier { 5 } else { 4 }, "{chain:?}");
    openssl_verify(&chain, OffsetDateTime::now_utc().unix_timestamp());
    let _ = child.kill().await;

    let records = hsm.audit();
    let leaf = records
        .iter()
        .find(|r| r["reason"] == "issued")
        .unwrap_or_else(|| panic!("no leaf record in {records:?}"));
    assert_eq!(leaf["signer"], if two_tier { "memory" } else { "pkcs11" });
    let issuing_records: Vec<_> = records
        .iter()
        .filter(|r| r["issued_kind"] == "issuing_ca")
        .collect();
    if two_tier {
        assert_eq!(issuing_records[0]["signer"], "pkcs11");
        assert_eq!(issuing_records[0]["certificate"], chain[1].as_str());
    } else {
        assert!(issuing_records.is_empty());
    }
    // The serving certificate is audited, and signed by the issuing CA
    // when there is one.
    let serving: Vec<_> = records
        .iter()
        .filter(|r| r["issued_kind"] == "serving")
        .collect();
    assert_eq!(serving.len(), 1, "{records:?}");
    assert_eq!(
        serving[0]["signer"],
        if two_tier { "memory" } else { "pkcs11" }
    );
    if two_tier {
        assert_eq!(serving[0]["issuer_key_id"], leaf["issuer_key_id"]);
    }

    // No CA private key in any file meshca read: the CA directory, the PIN
    // file, the SoftHSM2 config (the token's own files are the module's,
    // and hold the key encrypted under the PIN).
    let mut read = files(&ca);
    read.push(hsm.dir.path().join("pin"));
    read.push(hsm.conf());
    for f in read {
        let text = std::fs::read(&f).unwrap();
        assert!(
            !String::from_utf8_lossy(&text).contains("PRIVATE KEY"),
            "{} holds a private key",
            f.display()
        );
        let mut rd = &text[..];
        while let Ok(Some((kind, _))) = rustls_pki_types::pem::from_buf(&mut rd) {
            assert!(
                matches!(kind, rustls_pki_types::pem::SectionKind::Certificate),
                "{}: {kind:?}",
                f.display()
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn wrong_token_pin_key_or_module_fail_startup_with_a_clear_error() {
    let hsm = Hsm::new("meshca");
    let (_, ca) = hsm.init("intermediate", "ecdsa-p256");
    // MESHCA_SIGNER's object= names the key of a directory that names none
    // (a ca-key.uri in the directory would name it instead; last case).
    std::fs::remove_file(ca.join("ca-key.uri")).unwrap();
    let good = hsm.uri("intermediate");
    let wrong_pin = hsm.dir.path().join("wrong-pin");
    std::fs::write(&wrong_pin, "0000\n").unwrap();
    let not_pkcs11 = hsm.dir.path().join("not-a-module.so");
    std::fs::write(&not_pkcs11, "not an ELF library").unwrap();
    let cases: Vec<(String, &str, &str)> = vec![
        (
            good.replace(
                hsm.dir.path().join("pin").to_str().unwrap(),
                wrong_pin.to_str().unwrap(),
            ),
            "the PIN is incorrect",
            "wrong PIN",
        ),
        (
            good.replace("object=intermediate", "object=nope"),
            "no private key with label \"nope\"",
            "missing key",
        ),
        (
            good.replace("token=meshca", "token=other"),
            "token \"other\" not found",
            "wrong token",
        ),
        (
            good.replace(
                &module().display().to_string(),
                not_pkcs11.to_str().unwrap(),
            ),
            "cannot load it as a PKCS#11 library",
            "module failure",
        ),
        (
            good.replace(&module().display().to_string(), "/nonexistent/libpkcs11.so"),
            "cannot load it as a PKCS#11 library",
            "missing module",
        ),
        (
            format!("{good}&pin-value={PIN}"),
            "pin-value is refused",
            "PIN in the URI",
        ),
    ];
    for (uri, want, what, key_uri) in cases
        .into_iter()
        .map(|(u, w, what)| (u, w, what, None))
        .chain([(
            good.clone(),
            "no private key with label \"nope\"",
            "the directory names a missing key",
            Some("pkcs11:object=nope\n"),
        )])
    {
        if let Some(text) = key_uri {
            std::fs::write(ca.join("ca-key.uri"), text).unwrap();
        }
        let mut cmd = hsm.serve(&ca, &uri, &[]);
        cmd.stderr(std::process::Stdio::piped());
        let out = tokio::time::timeout(Duration::from_secs(30), cmd.output())
            .await
            .unwrap_or_else(|_| panic!("{what}: meshca did not exit"))
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: started anyway");
        assert!(
            stderr.contains(want),
            "{what}: wanted {want:?} in:\n{stderr}"
        );
        assert!(!stderr.contains("listening on"), "{what}: {stderr}");
        assert!(
            !stderr.contains(PIN),
            "{what}: the PIN is printed: {stderr}"
        );
    }
    // Nothing was issued by any of them.
    assert!(
        hsm.audit().iter().all(|r| r["serial"].is_null()),
        "{:?}",
        hsm.audit()
    );
}

/// The token disappears under a running CA (direct signing: no issuing CA
/// to ride it out): requests fail retryably with no certificate, and
/// issuance resumes once the token is back, on a rebuilt connection.
#[tokio::test(flavor = "multi_thread")]
async fn token_failure_at_runtime_stops_issuance_and_recovers() {
    let hsm = Hsm::new("meshca");
    let (_, ca) = hsm.init("intermediate", "ecdsa-p256");
    let (mut child, addr, _) = spawn_listening(hsm.serve(
        &ca,
        &hsm.uri("intermediate"),
        &[("MESHCA_ISSUING_CA", "off")],
    ))
    .await;
    let ident = client_identity(&hsm, &ca, "intermediate", ID);
    issue(addr, &ident)
        .await
        .expect("issued before the failure");
    let tokens = hsm.dir.path().join("tokens");
    let away = hsm.dir.path().join("tokens-away");
    std::fs::rename(&tokens, &away).unwrap();
    std::fs::create_dir(&tokens).unwrap();
    let err = issue(addr, &ident)
        .await
        .expect_err("no issuance without the token");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    std::fs::remove_dir(&tokens).unwrap();
    std::fs::rename(&away, &tokens).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let chain = loop {
        match issue(addr, &ident).await {
            Ok(c) => break c,
            Err(e) if Instant::now() < deadline => {
                assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("issuance did not resume: {e:?}"),
        }
    };
    openssl_verify(&chain, OffsetDateTime::now_utc().unix_timestamp());
    let _ = child.kill().await;
    let denied: Vec<_> = hsm
        .audit()
        .into_iter()
        .filter(|r| r["decision"] == "deny")
        .collect();
    assert!(
        !denied.is_empty()
            && denied.iter().all(|r| r["serial"].is_null()
                && r["reason"].as_str().unwrap_or("").starts_with("signer_")),
        "{denied:?}"
    );
}

/// Issuing CAs of 4 s roll over every 2 s while clients keep asking: no
/// request fails, every issuing CA is audited before use, and each one's
/// leaves verify to the root with openssl.
#[tokio::test(flavor = "multi_thread")]
async fn two_tier_rollover_under_load_fails_no_request() {
    let hsm = Hsm::new("meshca");
    let (_, ca) = hsm.init("intermediate", "ecdsa-p256");
    let (mut child, addr, _) = spawn_listening(hsm.serve(
        &ca,
        &hsm.uri("intermediate"),
        &[("MESHCA_ISSUING_CA_TTL", "4s")],
    ))
    .await;
    let ident = std::sync::Arc::new(client_identity(&hsm, &ca, "intermediate", ID));
    let until = Instant::now() + Duration::from_secs(10);
    let mut workers = Vec::new();
    for _ in 0..6 {
        let ident = ident.clone();
        workers.push(tokio::spawn(async move {
            let mut c = client(addr, &ident.2, Some((&ident.0, &ident.1)))
                .await
                .expect("connect");
            let (mut ok, mut failed, mut seen) = (0u32, Vec::new(), Vec::new());
            while Instant::now() < until {
                let csr = csr_for(&rcgen::KeyPair::generate().unwrap(), ID);
                match c.create_certificate(request(csr, 3600, &[])).await {
                    Ok(r) => {
                        ok += 1;
                        seen.push((
                            OffsetDateTime::now_utc().unix_timestamp(),
                            r.into_inner().cert_chain,
                        ));
                    }
                    Err(e) => failed.push(e),
                }
            }
            (ok, failed, seen)
        }));
    }
    let mut by_issuer = std::collections::BTreeMap::new();
    let mut total = 0;
    for w in workers {
        let (ok, failed, seen) = w.await.unwrap();
        assert!(
            failed.is_empty(),
            "failed requests during rollover: {failed:?}"
        );
        total += ok;
        for (at, chain) in seen {
            by_issuer.entry(chain[1].clone()).or_insert((at, chain));
        }
    }
    let _ = child.kill().await;
    assert!(total > 0);
    assert!(
        by_issuer.len() >= 3,
        "{} issuing CAs seen in 10 s of 4 s issuing CAs",
        by_issuer.len()
    );
    let audited: Vec<String> = hsm
        .audit()
        .iter()
        .filter(|r| r["issued_kind"] == "issuing_ca")
        .map(|r| r["certificate"].as_str().unwrap().to_string())
        .collect();
    for (issuing, (at, chain)) in &by_issuer {
        assert!(
            audited.contains(issuing),
            "issuing CA used without its audit record"
        );
        openssl_verify(chain, *at);
    }
}

/// Two-tier issuing with the file signer follows a hot-reloaded
/// intermediate: a new issuing CA under the new intermediate, audited, and
/// leaves that chain through both to the unchanged root.
#[tokio::test(flavor = "multi_thread")]
async fn two_tier_follows_a_hot_reloaded_intermediate() {
    use meshca::ca::generate::{write_file, KeyType};
    let pki = meshca::testing::TestPki::new(KeyType::EcdsaP256);
    let mut cfg = meshca::testing::test_config(pki.path_buf());
    cfg.custody.issuing_ttl = Some(Duration::from_secs(3600));
    let (app, audit) = meshca::testing::start_server(&cfg, Default::default()).await;
    assert_eq!(app.ca.snapshot().signer().kind(), "memory");
    let (cert, key) =
        meshca::testing::client_identity(&app.custody.snapshot(), ID, &validity_hours(-1, 1));
    let ident = (cert, key, pki.ca.root_cert.clone());
    let chain = issue(app.addr, &ident).await.unwrap();
    assert_eq!(chain[2], pki.ca.ca_cert);

    let next = meshca::testing::new_intermediate(&pki.ca, OffsetDateTime::now_utc());
    write_file(&pki.path().join("ca-key.pem"), next.ca_key.as_bytes(), true).unwrap();
    write_file(
        &pki.path().join("cert-chain.pem"),
        next.cert_chain().as_bytes(),
        false,
    )
    .unwrap();
    write_file(
        &pki.path().join("ca-cert.pem"),
        next.ca_cert.as_bytes(),
        false,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let chain = loop {
        let chain = issue(app.addr, &ident).await.unwrap();
        if chain[2] == next.ca_cert {
            break chain;
        }
        assert!(
            Instant::now() < deadline,
            "still issuing under the old intermediate"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    openssl_verify(&chain, OffsetDateTime::now_utc().unix_timestamp());
    let issuing: Vec<_> = audit
        .records()
        .into_iter()
        .filter(|r| r.issued_kind.as_deref() == Some("issuing_ca"))
        .collect();
    assert_eq!(issuing.len(), 2, "one issuing CA per custody bundle");
    assert_eq!(issuing[1].certificate.as_deref(), Some(chain[1].as_str()));
    assert_eq!(
        issuing[1].issuer_key_id.as_deref(),
        Some(app.custody.snapshot().key_id())
    );
    app.shutdown().await.unwrap();
}

/// The offline-root path: `meshca init --pkcs11` without a root writes a
/// CSR signed by the token key; openssl (standing in for the offline root)
/// signs it, and meshca serves with the result.
#[tokio::test(flavor = "multi_thread")]
async fn a_csr_for_an_offline_root_is_signed_elsewhere_and_served() {
    let hsm = Hsm::new("meshca");
    let root = hsm.dir.path().join("root");
    let ca = hsm.dir.path().join("ca");
    run(hsm.meshca().args(["init", "--out"]).arg(&root));
    run(hsm
        .meshca()
        .args(["init", "--out"])
        .arg(&ca)
        .args(["--pkcs11", &hsm.uri("intermediate")]));
    let csr = ca.join("ca-csr.pem");
    run(Command::new("openssl")
        .args(["req", "-verify", "-noout", "-in"])
        .arg(&csr));
    std::fs::write(
        hsm.dir.path().join("ext.cnf"),
        "basicConstraints=critical,CA:TRUE,pathlen:1\nkeyUsage=critical,keyCertSign,cRLSign,digitalSignature\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n",
    )
    .unwrap();
    run(Command::new("openssl")
        .args(["x509", "-req", "-days", "30", "-in"])
        .arg(&csr)
        .arg("-CA")
        .arg(root.join("root-cert.pem"))
        .arg("-CAkey")
        .arg(root.join("root-key.pem"))
        .args(["-set_serial", "4242", "-extfile"])
        .arg(hsm.dir.path().join("ext.cnf"))
        .arg("-out")
        .arg(ca.join("ca-cert.pem")));
    std::fs::remove_file(&csr).unwrap();
    let root_pem = std::fs::read_to_string(root.join("root-cert.pem")).unwrap();
    let ca_pem = std::fs::read_to_string(ca.join("ca-cert.pem")).unwrap();
    std::fs::write(ca.join("cert-chain.pem"), format!("{ca_pem}{root_pem}")).unwrap();
    std::fs::write(ca.join("root-cert.pem"), &root_pem).unwrap();
    let (mut child, addr, _) = spawn_listening(hsm.serve(&ca, &hsm.uri("intermediate"), &[])).await;
    let chain = issue(addr, &client_identity(&hsm, &ca, "intermediate", ID))
        .await
        .expect("issued");
    let _ = child.kill().await;
    assert_eq!(chain.len(), 5, "two-tier is on by default with pkcs11");
    openssl_verify(&chain, OffsetDateTime::now_utc().unix_timestamp());
}

/// Copies the CA files of `from` into `to` atomically (a new directory
/// renamed into place, as a Secret volume swaps), leaving `ca-key.uri`
/// out or replacing its text.
fn stage(from: &Path, to: &Path, key_uri: Option<&str>) {
    let tmp = to.with_extension("staging");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    for f in ["ca-cert.pem", "cert-chain.pem", "root-cert.pem"] {
        std::fs::copy(from.join(f), tmp.join(f)).unwrap();
    }
    if let Some(text) = key_uri {
        std::fs::write(tmp.join("ca-key.uri"), text).unwrap();
    }
    let _ = std::fs::remove_dir_all(to);
    std::fs::rename(&tmp, to).unwrap();
}

async fn wait_metric(admin: std::net::SocketAddr, needle: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = meshca::testing::http_get(admin, "/metrics").await;
        if body.contains(needle) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: no {needle} in\n{body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A root rotation with both generations' intermediate keys in one
/// SoftHSM2 token. The staged generation names its key with `ca-key.uri`
/// (what `meshca init --pkcs11` writes; module, token and PIN stay those
/// of MESHCA_SIGNER). A staged generation naming no key, a key the token
/// lacks, or a key that is not its certificate's is refused with its
/// reason, and no rotation starts. Then trust -> switch -> retire under
/// load: no renewal fails, each response verifies to its own roots
/// (webpki, and openssl per signing certificate), issuing CAs chain to the
/// right intermediate, and the gates wait for the leaves they must. The
/// promoted directory (copied with its `ca-key.uri`) keeps signing with
/// the new key, also after a restart with MESHCA_SIGNER unchanged.
#[test_case::test_case("auto" ; "two tier")]
#[test_case::test_case("off" ; "direct")]
#[tokio::test(flavor = "multi_thread")]
async fn root_rotation_with_both_keys_in_the_token(issuing: &str) {
    use meshca::rotation::phase::Phase;
    use rotation_check::{check, Gen, Ident, Workers};
    let two_tier = issuing != "off";
    let hsm = Hsm::new("meshca");
    let (_, gen1) = hsm.generation("gen1", "ica-1");
    let (_, gen2) = hsm.generation("gen2", "ica-2");
    let ca_dir = hsm.dir.path().join("cacerts");
    let next_dir = hsm.dir.path().join("next");
    stage(&gen1, &ca_dir, None);
    let settings = meshca::rotation::RotationSettings {
        next_dir: next_dir.clone(),
        state_file: hsm.dir.path().join("rotation.json"),
        mark_slack: Duration::from_secs(1),
    };
    let (next_s, state_s) = (
        next_dir.to_str().unwrap().to_string(),
        settings.state_file.to_str().unwrap().to_string(),
    );
    let env = [
        ("MESHCA_ISSUING_CA", issuing),
        ("MESHCA_ISSUING_CA_TTL", "8s"),
        ("DEFAULT_WORKLOAD_CERT_TTL", "6s"),
        ("MAX_WORKLOAD_CERT_TTL", "6s"),
        ("MESHCA_LIFETIME_JITTER", "false"),
        ("MESHCA_RELOAD_POLL", "200ms"),
        ("MESHCA_ROTATION_NEXT_DIR", next_s.as_str()),
        ("MESHCA_ROTATION_STATE", state_s.as_str()),
        ("MESHCA_ROTATION_MARK_SLACK", "1s"),
    ];
    // MESHCA_SIGNER names generation 1's key for the whole test.
    let uri = hsm.uri("ica-1");
    let (mut child, addr, admin) = spawn_listening(hsm.serve(&ca_dir, &uri, &env)).await;
    let status =
        || meshca::rotation::status(&ca_dir, &settings, OffsetDateTime::now_utc()).unwrap();
    let (chain, key, trust) = client_identity(&hsm, &gen1, "ica-1", ID);
    let seeds = (0..3)
        .map(|_| Ident {
            id: ID.into(),
            chain: chain.clone(),
            key: key.clone(),
            trust: trust.clone(),
        })
        .collect();
    let load = Workers::start(addr, seeds);
    load.seen_after(Instant::now(), "idle").await;

    // Fail closed: a staged generation whose key cannot be the one in the
    // token that matches its certificate starts nothing.
    for (key_uri, reason) in [
        (None, "signer_next_key_unnamed"),
        (Some("pkcs11:object=nope\n"), "signer_key_not_found"),
        (Some("pkcs11:object=ica-1\n"), "ca_key_mismatch"),
    ] {
        stage(&gen2, &next_dir, key_uri);
        wait_metric(
            admin,
            &format!("meshca_rotation_blocked_total{{reason=\"{reason}\"}}"),
            reason,
        )
        .await;
        let st = status();
        assert_eq!(st.phase, Phase::Idle, "{reason}: {st}");
    }
    assert!(
        load.seen()
            .iter()
            .all(|s| !s.chain[s.chain.len() - 1].contains(
                std::fs::read_to_string(gen2.join("root-cert.pem"))
                    .unwrap()
                    .trim()
            )),
        "a refused generation's root was handed out"
    );

    // The generation as `meshca init --pkcs11` wrote it.
    let tmp = next_dir.with_extension("full");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    for f in [
        "ca-cert.pem",
        "cert-chain.pem",
        "root-cert.pem",
        "ca-key.uri",
    ] {
        std::fs::copy(gen2.join(f), tmp.join(f)).unwrap();
    }
    std::fs::remove_dir_all(&next_dir).unwrap();
    std::fs::rename(&tmp, &next_dir).unwrap();
    let wait = |p: Phase, within: u64| {
        let status = &status;
        async move {
            let deadline = Instant::now() + Duration::from_secs(within);
            loop {
                let st = status();
                if st.phase == p {
                    return Instant::now();
                }
                assert!(
                    Instant::now() < deadline,
                    "no {p:?} within {within}s:\n{st}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let observed = vec![
        (Phase::Trust, wait(Phase::Trust, 10).await),
        (Phase::Switched, wait(Phase::Switched, 30).await),
        (Phase::Retired, wait(Phase::Retired, 30).await),
    ];
    load.seen_after(Instant::now(), "retired").await;
    let progress = status().progress;
    let (seen, failures) = load.stop().await;
    assert!(
        failures.is_empty(),
        "{} failed renewals, first: {:?}",
        failures.len(),
        failures.first()
    );
    let read = |d: &Path, f: &str| std::fs::read_to_string(d.join(f)).unwrap();
    let old = Gen {
        root: read(&gen1, "root-cert.pem"),
        intermediate: read(&gen1, "ca-cert.pem"),
    };
    let new = Gen {
        root: read(&gen2, "root-cert.pem"),
        intermediate: read(&gen2, "ca-cert.pem"),
    };
    let sum = check(&seen, &old, &new, two_tier, &observed, &progress);
    eprintln!(
        "PKCS#11 root rotation ({issuing}): {} responses, 0 failed; per phase {:?}; signing certificates per phase {:?}; {} openssl verifications",
        sum.responses, sum.per_phase, sum.signers_per_phase, sum.openssl_runs
    );
    if two_tier {
        // Issuing CAs of generation 2 were signed in the token by ica-2.
        let key2 = meshca::ca::bundle::BundleFiles::read_dir_without_key(&gen2)
            .unwrap()
            .identify()
            .unwrap()
            .0;
        let audit = hsm.audit();
        for (phase, cert) in sum.issuing.iter().filter(|(p, _)| *p >= Phase::Switched) {
            let rec = audit
                .iter()
                .find(|r| r["certificate"] == cert.as_str())
                .unwrap_or_else(|| panic!("{phase:?}: issuing CA without its audit record"));
            assert_eq!(rec["signer"], "pkcs11");
            assert_eq!(rec["issuer_key_id"], key2.as_str());
        }
    }

    // Promote by copying the whole directory (ca-key.uri included): the
    // rotation closes, and generation 2's key keeps signing.
    std::fs::remove_dir_all(&ca_dir).unwrap();
    std::fs::rename(&next_dir, &ca_dir).unwrap();
    wait(Phase::Idle, 10).await;
    let _ = child.kill().await;
    let _ = child.wait().await;

    // A restart on the promoted directory, MESHCA_SIGNER still naming ica-1:
    // the directory's own ca-key.uri decides.
    let (mut child, addr, _) = spawn_listening(hsm.serve(&ca_dir, &uri, &env)).await;
    let (c2, k2, t2) = client_identity(&hsm, &gen2, "ica-2", ID);
    let ident = Ident {
        id: ID.into(),
        chain: c2,
        key: k2,
        trust: t2,
    };
    let (chain, _) = rotation_check::renew(addr, &ident)
        .await
        .expect("issued after restart");
    let _ = child.kill().await;
    assert_eq!(
        chain[if two_tier { 2 } else { 1 }],
        new.intermediate,
        "generation 2 signs after the restart"
    );
    openssl_verify(&chain, OffsetDateTime::now_utc().unix_timestamp());
}
