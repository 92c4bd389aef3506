//! `meshca revoke` end to end, without Kubernetes: a running server writes
//! its chained audit log to a file, the release CLI finds an identity's
//! serials in it, the server picks the revocation up (CRL on the admin port,
//! one `revoked` audit record per serial, in its own hash chain), and the
//! denylist file written by `--deny-file` stops new issuance.
#![allow(clippy::unwrap_used)]

mod revoking;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use meshca::app::App;
use meshca::ca::generate::KeyType;
use meshca::ca::CaBundle;
use meshca::config::{AuditSinkKind, Config};
use meshca::testing::{self, TestPki};
use revoking::{json_lines, printed_serials};
use time::OffsetDateTime;

fn meshca(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args(args)
        .output()
        .unwrap()
}

/// A server of `pki` writing its chained audit log to `dir/audit.log` and
/// polling the denylist file `dir/denylist` every 100 ms.
fn file_config(pki: &TestPki, dir: &Path) -> Config {
    let mut cfg = testing::test_config(pki.path_buf());
    cfg.audit.sink = AuditSinkKind::File;
    cfg.audit.file = dir.join("audit.log");
    cfg.kill_switch.denylist = meshca::denylist::DenylistSettings {
        file: Some(dir.join("denylist")),
        poll: Duration::from_millis(100),
        configmap: None,
    };
    cfg
}

/// A CreateCertificate for `id` over mTLS with a fresh client certificate
/// for `id` from `bundle`.
async fn request_as(
    app: &App,
    pki: &TestPki,
    bundle: &CaBundle,
    id: &str,
) -> Result<tonic::Response<meshca::proto::IstioCertificateResponse>, tonic::Status> {
    let (cert, key) = testing::client_identity(bundle, id, &testing::validity_hours(-1, 1));
    let mut c = testing::client(app.addr, &pki.ca.root_cert, Some((&cert, &key)))
        .await
        .unwrap();
    let k = rcgen::KeyPair::generate().unwrap();
    c.create_certificate(testing::request(testing::csr_for(&k, id), 0, &[]))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoke_finds_serials_in_the_audit_log_and_the_server_enforces_them() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.log");
    let store = dir.path().join("revoked-serials.jsonl");
    let deny = dir.path().join("denylist");
    let mut cfg = file_config(&pki, dir.path());
    cfg.kill_switch.revocation = Some(meshca::revocation::RevocationSettings {
        file: Some(store.clone()),
        configmap: None,
        poll: Duration::from_millis(100),
        crl_validity: Duration::from_secs(3600),
        publish: None,
    });
    let app = meshca::app::App::start(&cfg, Default::default())
        .await
        .unwrap();
    let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
    let (a, b) = (
        "spiffe://cluster.local/ns/shop/sa/cart",
        "spiffe://cluster.local/ns/shop/sa/web",
    );
    let ask = |id: &'static str| request_as(&app, &pki, &bundle, id);
    let mut serials_a = Vec::new();
    for id in [a, a, b] {
        let chain = ask(id).await.unwrap().into_inner().cert_chain;
        if id == a {
            serials_a.push(testing::leaf_serial(&chain[0]));
        }
    }
    serials_a.sort();

    // Dry run writes nothing.
    let audit_s = audit.to_str().unwrap();
    let store_s = store.to_str().unwrap();
    let deny_s = deny.to_str().unwrap();
    let out = meshca(&[
        "revoke",
        "--identity",
        a,
        "--reason",
        "key-compromise",
        "--dry-run",
        "--revocation-file",
        store_s,
        audit_s,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!store.exists());
    let out = meshca(&[
        "revoke",
        "--identity",
        a,
        "--reason",
        "key-compromise",
        "--by",
        "INC-1",
        "--deny-file",
        deny_s,
        "--revocation-file",
        store_s,
        audit_s,
    ]);
    assert_eq!(
        printed_serials(&out),
        serials_a,
        "exactly the identity's two certificates"
    );
    let stored: Vec<String> = meshca::revocation::read_store(&store)
        .unwrap()
        .into_iter()
        .map(|r| r.serial)
        .collect();
    assert_eq!(stored.len(), 2);
    assert!(std::fs::read_to_string(&deny)
        .unwrap()
        .contains(&format!("identity {a}")));
    // A bad reason is refused before anything is written.
    let out = meshca(&[
        "revoke",
        "--serial",
        "ab",
        "--reason",
        "because",
        "--revocation-file",
        store_s,
        audit_s,
    ]);
    assert!(!out.status.success());

    // The server: CRL on the admin port lists both serials; the denylist stops `a`.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, body) = testing::http_get(app.admin_addr, "/ca-crl.pem").await;
        let listed = (code == 200).then(|| {
            let mut s = revoking::crl(&body).1;
            s.sort();
            s
        });
        if listed.as_ref() == Some(&serials_a) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "CRL never listed {serials_a:?}: {listed:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while ask(a).await.is_ok() {
        assert!(Instant::now() < deadline, "denylist file never took effect");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ask(b).await.unwrap();

    // `--undo` lifts one revocation, and only it: the CRL drops that serial.
    let out = meshca(&[
        "revoke",
        "--undo",
        "--serial",
        &serials_a[0],
        "--by",
        "INC-1",
        "--revocation-file",
        store_s,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Without --by an un-revocation is refused (who lifted it is recorded).
    let out = meshca(&[
        "revoke",
        "--undo",
        "--serial",
        &serials_a[1],
        "--revocation-file",
        store_s,
    ]);
    assert!(!out.status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = testing::http_get(app.admin_addr, "/ca-crl.pem").await;
        let listed = revoking::crl(&body).1;
        if listed == [serials_a[1].clone()] {
            break;
        }
        assert!(Instant::now() < deadline, "CRL after --undo: {listed:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    app.shutdown().await.unwrap();
    let out = meshca(&[
        "audit",
        "query",
        "--reason",
        "unrevoked",
        "-o",
        "json",
        audit_s,
    ]);
    let un = json_lines(&out);
    assert_eq!(un.len(), 1, "{un:?}");
    assert_eq!(un[0]["serial"], serials_a[0].as_str());
    assert!(un[0]["detail"].as_str().unwrap().contains("INC-1"));

    // The audit log: still one intact chain, with one `revoked` record per serial.
    let out = meshca(&["audit", "verify", "--strict", audit_s]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = meshca(&[
        "audit", "query", "--reason", "revoked", "-o", "json", audit_s,
    ]);
    let mut revoked: Vec<String> = json_lines(&out)
        .into_iter()
        .map(|v| {
            assert_eq!(v["revocation_reason"], "key-compromise");
            assert_eq!(v["requested_identity"], a);
            v["serial"].as_str().unwrap().to_string()
        })
        .collect();
    revoked.sort();
    assert_eq!(revoked, serials_a);
    let out = meshca(&["audit", "query", "--reason", "denylist_identity", audit_s]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("denylist_identity"));
}

/// Trust-domain aliases: authorization accepts `alias.local` identities as
/// the mesh's own, so a denylist entry and `meshca revoke --identity`
/// written with the mesh trust domain must catch the alias form too (and
/// the other way round).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trust_domain_aliases_do_not_get_around_the_denylist_or_revoke() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.log");
    let store = dir.path().join("revoked-serials.jsonl");
    let deny = dir.path().join("denylist");
    std::fs::write(&deny, "").unwrap();
    let mut cfg = file_config(&pki, dir.path());
    cfg.trust_domain_aliases = vec![meshca::identity::TrustDomain::new("alias.local").unwrap()];
    let app = meshca::app::App::start(&cfg, Default::default())
        .await
        .unwrap();
    let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
    let mesh = "spiffe://cluster.local/ns/shop/sa/cart";
    let alias = "spiffe://alias.local/ns/shop/sa/cart";
    let ask = |id: &'static str| request_as(&app, &pki, &bundle, id);
    // One certificate under each spelling, before any deny.
    let serial_of = |chain: Vec<String>| testing::leaf_serial(&chain[0]);
    let mut both = vec![
        serial_of(ask(mesh).await.unwrap().into_inner().cert_chain),
        serial_of(ask(alias).await.unwrap().into_inner().cert_chain),
    ];
    both.sort();

    // `revoke --identity` in either spelling finds both certificates
    // (TRUST_DOMAIN_ALIASES as the server's pod has it).
    let audit_s = audit.to_str().unwrap();
    let store_s = store.to_str().unwrap();
    for target in [mesh, alias] {
        let out = Command::new(env!("CARGO_BIN_EXE_meshca"))
            .env("TRUST_DOMAIN_ALIASES", "alias.local")
            .args(["revoke", "--identity", target, "--reason", "key-compromise"])
            .args(["--dry-run", "--revocation-file", store_s, audit_s])
            .output()
            .unwrap();
        assert_eq!(printed_serials(&out), both, "revoke --identity {target}");
        // Without the alias the two spellings are different identities.
        let out = Command::new(env!("CARGO_BIN_EXE_meshca"))
            .env_remove("TRUST_DOMAIN_ALIASES")
            .args(["revoke", "--identity", target, "--reason", "key-compromise"])
            .args(["--dry-run", "--revocation-file", store_s, audit_s])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
    }

    // The denylist entry names the mesh spelling; the alias spelling is refused too.
    std::fs::write(&deny, format!("identity {mesh}\n")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while ask(mesh).await.is_ok() {
        assert!(Instant::now() < deadline, "denylist file never took effect");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let e = ask(alias).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    // And an entry in the alias spelling catches the mesh one.
    std::fs::write(&deny, format!("identity {alias}\n")).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let e = ask(mesh).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    app.shutdown().await.unwrap();
    let out = meshca(&[
        "audit",
        "query",
        "--reason",
        "denylist_identity",
        "-o",
        "json",
        audit_s,
    ]);
    let denied: Vec<String> = json_lines(&out)
        .into_iter()
        .map(|v| v["caller_identity"].as_str().unwrap().to_string())
        .collect();
    assert!(denied.contains(&alias.to_string()), "{denied:?}");
    assert!(denied.contains(&mesh.to_string()), "{denied:?}");
}

/// The runbook collects every file of the log: `meshca audit cat LOG`
/// prints each rotated file rotation kept (more than the newest two, and
/// more than `--audit-max-files` while they hold recent issuance records),
/// oldest first. The chain of what it prints verifies, and `revoke` finds
/// every serial in it; the newest two files miss some.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_cat_collects_every_rotated_file_for_revoke() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = file_config(&pki, dir.path());
    cfg.audit.max_bytes = 4096;
    cfg.audit.max_files = 2;
    let app = meshca::app::App::start(&cfg, Default::default())
        .await
        .unwrap();
    let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
    let a = "spiffe://cluster.local/ns/shop/sa/cart";
    let mut serials = Vec::new();
    for _ in 0..12 {
        let chain = request_as(&app, &pki, &bundle, a)
            .await
            .unwrap()
            .into_inner()
            .cert_chain;
        serials.push(testing::leaf_serial(&chain[0]));
    }
    serials.sort();
    app.shutdown().await.unwrap();

    let log = dir.path().join("audit.log");
    let log_s = log.to_str().unwrap();
    let out = meshca(&["audit", "cat", "--list", log_s]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    eprintln!("audit files: {}", listed.len());
    assert!(listed.len() > 2, "rotation kept {listed:?}");
    assert_eq!(listed.last().map(String::as_str), Some(log_s));
    let out = meshca(&["audit", "cat", log_s]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let all = dir.path().join("collected.log");
    std::fs::write(&all, &out.stdout).unwrap();
    let all_s = all.to_str().unwrap();
    let verify = meshca(&["audit", "verify", all_s]);
    assert!(
        verify.status.success(),
        "{}",
        String::from_utf8_lossy(&verify.stderr)
    );
    let store = dir.path().join("store.jsonl");
    let store_s = store.to_str().unwrap();
    let revoke = |files: &[&str]| {
        let mut args = vec![
            "revoke",
            "--identity",
            a,
            "--reason",
            "key-compromise",
            "--dry-run",
            "--revocation-file",
            store_s,
        ];
        args.extend_from_slice(files);
        printed_serials(&meshca(&args))
    };
    assert_eq!(revoke(&[all_s]), serials, "every serial of the identity");
    let newest_two = [format!("{log_s}.1"), log_s.to_string()];
    let two = revoke(&[&newest_two[0], &newest_two[1]]);
    eprintln!(
        "serials found: {} of {} in every file, {} in the newest two",
        serials.len(),
        serials.len(),
        two.len()
    );
    assert!(two.len() < serials.len());
}
