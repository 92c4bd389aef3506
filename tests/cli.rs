//! What a new user does first: `meshca init`, and `meshca serve --dev`
//! (README command one) started twice, called with its dev client identity.
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

use meshca::ca::CaBundle;
use rcgen::KeyPair;
use time::OffsetDateTime;

/// Runs `cmd` to its end; it must succeed (its stderr is the message).
fn succeeded(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn init_writes_a_cacerts_bundle_meshca_loads() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cacerts");
    for key_type in ["ecdsa-p256", "rsa2048"] {
        succeeded(
            Command::new(env!("CARGO_BIN_EXE_meshca"))
                .args([
                    "init",
                    "--force",
                    "--key-type",
                    key_type,
                    "--intermediate-ttl",
                    "720h",
                    "--out",
                ])
                .arg(&out),
        );
        let b = CaBundle::load_dir(&out, OffsetDateTime::now_utc()).unwrap();
        let life = b.signing_not_after() - OffsetDateTime::now_utc();
        assert!(
            life <= time::Duration::hours(720) && life > time::Duration::hours(719),
            "{life}"
        );
        assert_eq!(
            b.key_algorithm(),
            if key_type == "rsa2048" {
                "rsa"
            } else {
                "ecdsa-p256"
            }
        );
    }
    // Without --force an existing bundle is never overwritten.
    let again = Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args(["init", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
}

/// Starts `meshca serve --dev` and returns (child, gRPC addr).
async fn serve_dev(data: &std::path::Path) -> (tokio::process::Child, std::net::SocketAddr) {
    let cmd = meshca::testing::serve_dev_command(env!("CARGO_BIN_EXE_meshca").as_ref(), data);
    let (child, addr, _) = meshca::testing::spawn_listening(cmd).await;
    (child, addr)
}

#[tokio::test]
async fn dev_mode_serves_and_reuses_its_ca_across_restarts() {
    let data = tempfile::tempdir().unwrap();
    let mut fingerprints = Vec::new();
    for _ in 0..2 {
        let (mut child, addr) = serve_dev(data.path()).await;
        let mut c = meshca::testing::dev_client(addr, data.path()).await;
        let id = "spiffe://cluster.local/ns/default/sa/default";
        let key = KeyPair::generate().unwrap();
        let chain = c
            .create_certificate(meshca::testing::request(
                meshca::testing::csr_for(&key, id),
                0,
                &[],
            ))
            .await
            .unwrap()
            .into_inner()
            .cert_chain;
        let root = std::fs::read_to_string(data.path().join("dev-client/root-cert.pem")).unwrap();
        assert_eq!(chain.last().unwrap(), &root);
        fingerprints.push(
            CaBundle::load_dir(&data.path().join("cacerts"), OffsetDateTime::now_utc())
                .unwrap()
                .fingerprint(),
        );
        child.kill().await.unwrap();
    }
    assert_eq!(
        fingerprints[0], fingerprints[1],
        "the second start reuses the first start's CA"
    );
}

/// The shell blocks of README's "Run it locally" section, in order.
fn readme_local_commands() -> Vec<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("Run it locally"))
        .expect("README has a \"Run it locally\" section");
    section
        .split("```sh\n")
        .skip(1)
        .map(|b| b.split("```").next().unwrap().to_string())
        .collect()
}

/// The test below stands the built binary in for `cargo run --release --`; this one checks
/// that cargo itself picks that binary: with meshca-bench beside it, `cargo run` without
/// `--bin` stops with "could not determine which binary to run" unless `default-run` names it.
#[test]
fn cargo_run_without_bin_runs_the_ca() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = succeeded(
        Command::new(cargo)
            .args([
                "metadata",
                "--no-deps",
                "--offline",
                "--format-version",
                "1",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR")),
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let package = meta["packages"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["name"] == "meshca"))
        .expect("the meshca package");
    let bins: Vec<&str> = package["targets"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| {
            t["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "bin"))
        })
        .filter_map(|t| t["name"].as_str())
        .collect();
    let runs = match bins.as_slice() {
        [only] => Some(*only),
        _ => package["default_run"].as_str(),
    };
    assert_eq!(runs, Some("meshca"), "binaries {bins:?}");
}

/// README's first two commands as a new user runs them, from an empty HOME, with the built
/// binary standing in for `cargo run --release --`: the first serves, the second prints a
/// verified chain for the dev identity, in seconds. A README edit that breaks them, or a second
/// command that needs another build (`cargo run --example`, another profile), fails here.
#[tokio::test]
async fn readme_first_two_commands_give_a_certificate() {
    let blocks = readme_local_commands();
    assert!(blocks.len() >= 2, "{blocks:?}");
    let bin = env!("CARGO_BIN_EXE_meshca");
    let as_built = |b: &str| {
        assert!(
            b.contains("cargo run --release -- "),
            "README's command must run the release binary the first command built: {b}"
        );
        b.replace("cargo run --release --", bin)
    };
    let serve = as_built(&blocks[0]);
    let request = as_built(&blocks[1]);
    assert_eq!(serve.trim().lines().count(), 1, "{serve}");

    let home = tempfile::tempdir().unwrap();
    // A platform engineer's shell: an exported KUBECONFIG, here for a cluster that does not
    // answer. Dev mode must not touch it (it made the second command fail with
    // renewal_index_not_ready; with a production kubeconfig a laptop watched every pod).
    let kubeconfig = home.path().join(".kube/config");
    std::fs::create_dir_all(kubeconfig.parent().unwrap()).unwrap();
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:9'}}]\nusers: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n",
    )
    .unwrap();
    // A new user's environment: an otherwise empty HOME, none of meshca's settings.
    let user_env = |c: &mut tokio::process::Command| {
        c.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", home.path())
            .env("KUBECONFIG", &kubeconfig);
    };
    let mut cmd = tokio::process::Command::new("bash");
    user_env(&mut cmd);
    // Free ports instead of 15012/15014, which other tests or servers may hold.
    cmd.arg("-c")
        .arg(format!("exec {}", serve.trim()))
        .env("MESHCA_LISTEN", "127.0.0.1:0")
        .env("MESHCA_ADMIN_LISTEN", "127.0.0.1:0")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().unwrap();
    let (addr, _) =
        meshca::testing::await_listening(child.stderr.take().unwrap(), Duration::from_secs(30))
            .await;

    let mut cmd = tokio::process::Command::new("bash");
    user_env(&mut cmd);
    let started = std::time::Instant::now();
    let out = cmd
        .arg("-c")
        .arg(format!("set -eu\n{request}"))
        .env("CA_ADDR", addr.to_string())
        .output()
        .await
        .unwrap();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "README's second command: {stderr}");
    let dev = home.path().join(".local/share/meshca/dev-client");
    let root = std::fs::read_to_string(dev.join("root-cert.pem")).unwrap();
    let trust = meshca::certs::Trust::from_pem(&root).unwrap();
    let rows = meshca::certs::pem_rows(
        &String::from_utf8_lossy(&out.stdout),
        &trust,
        OffsetDateTime::now_utc(),
    )
    .unwrap();
    assert_eq!(
        rows.iter().map(|r| r.kind.as_str()).collect::<Vec<_>>(),
        ["Leaf", "Intermediate", "Root", "Root"]
    );
    assert_eq!(
        rows[0].certificate_name,
        "spiffe://cluster.local/ns/default/sa/default"
    );
    assert!(rows.iter().all(|r| r.valid_cert), "{rows:?}");
    assert!(
        took < Duration::from_secs(20),
        "a first certificate in seconds, took {took:?}"
    );
    child.kill().await.unwrap();
}

/// The shipped binary holds no load generator: `meshca-bench` signs client
/// certificates without an audit record, so it is a binary of its own.
#[test]
fn meshca_has_no_bench_subcommand() {
    let bin = env!("CARGO_BIN_EXE_meshca");
    let out = Command::new(bin).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    assert!(help.contains("serve"), "{help}");
    assert!(
        !help.lines().any(|l| l.trim_start().starts_with("bench")),
        "{help}"
    );
    let out = Command::new(bin)
        .args(["bench", "--help"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "`meshca bench` must not exist");
}

/// Dev mode's client certificate is audited like every certificate meshca
/// signs: a `dev_client` record with the serial of the certificate written
/// to `dev-client/`.
#[tokio::test]
async fn dev_mode_audits_its_client_certificate() {
    let data = tempfile::tempdir().unwrap();
    let log = data.path().join("audit.log");
    let mut cmd =
        meshca::testing::serve_dev_command(env!("CARGO_BIN_EXE_meshca").as_ref(), data.path());
    cmd.args(["--audit-sink", "file", "--audit-file"]).arg(&log);
    let (mut child, _, _) = meshca::testing::spawn_listening(cmd).await;
    let chain = std::fs::read_to_string(data.path().join("dev-client/cert-chain.pem")).unwrap();
    let serial = meshca::testing::leaf_serial(&chain);
    let mut found = Vec::new();
    for _ in 0..100 {
        found = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|r| r["issued_kind"] == "dev_client")
            .collect();
        if !found.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    child.kill().await.unwrap();
    assert_eq!(found.len(), 1, "one dev_client record: {found:?}");
    let r = &found[0];
    assert_eq!(r["reason"], "dev_client_issued");
    assert_eq!(r["decision"], "allow");
    assert_eq!(r["serial"], serial.as_str());
    assert_eq!(
        r["requested_identity"],
        "spiffe://cluster.local/ns/default/sa/default"
    );
}

/// `n` audit lines as `meshca audit query` reads them (the hash chain is
/// `audit verify`'s business, not the query's).
fn audit_lines(n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                r#"{{"type":"audit","seq":{i},"prev":"x","time":"2026-01-01T00:00:00Z","request_id":"r{i}","peer":null,"authn_method":null,"caller_identity":null,"caller_pod":null,"caller_pod_uid":null,"node":null,"requested_identity":"spiffe://cluster.local/ns/a/sa/b","impersonated":false,"decision":"allow","reason":"issued","detail":null,"evidence":null,"serial":"0a{i:04x}","spki_sha256":null,"csr_sha256":null,"not_before":null,"not_after":null,"issuer_key_id":null,"latency_ms":1.0}}"#
            ) + "\n"
        })
        .collect()
}

/// `meshca audit query ... | head`: the reader goes away after one line;
/// the query ends quietly (no panic, exit 101 before) and says nothing on stderr.
#[test]
fn a_query_into_a_closed_pipe_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("audit.log");
    std::fs::write(&log, audit_lines(20_000)).unwrap();
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "set -o pipefail; {} audit query -o json {} | head -n 1",
            env!("CARGO_BIN_EXE_meshca"),
            log.display()
        ))
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status);
    assert!(stderr.is_empty(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
}

/// A routine error is one line naming what failed (the file's path), never a
/// backtrace, even with RUST_BACKTRACE set.
#[test]
fn routine_errors_are_one_line_and_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such.log");
    for args in [
        vec!["audit", "verify", missing.to_str().unwrap()],
        vec!["audit", "query", missing.to_str().unwrap()],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_meshca"))
            .args(&args)
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{stderr}");
        assert!(stderr.contains(missing.to_str().unwrap()), "{stderr}");
    }
}

/// `--serial` finds the issuance and the callers presenting the certificate,
/// in any common spelling; `--since` takes a duration back from now.
#[test]
fn query_by_serial_and_relative_time() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("audit.log");
    std::fs::write(&log, audit_lines(40)).unwrap();
    let query = |extra: &[&str]| {
        let out = succeeded(
            Command::new(env!("CARGO_BIN_EXE_meshca"))
                .args(["audit", "query", "-o", "json"])
                .args(extra)
                .arg(&log),
        );
        String::from_utf8_lossy(&out.stdout).lines().count()
    };
    assert_eq!(query(&["--serial", "0x0A:00:1f"]), 1);
    assert_eq!(query(&["--serial", "a001f"]), 1);
    assert_eq!(query(&["--serial", "ff"]), 0);
    // The records are from 2026-01-01: within the last 10,000 days, not the last 15 minutes.
    assert_eq!(query(&["--since", "10000d"]), 40);
    assert_eq!(query(&["--since", "15m"]), 0);
    assert_eq!(query(&["--until", "15m"]), 40);
}

/// `audit keygen` refuses to replace a key without --force, as `init` does.
#[test]
fn keygen_keeps_an_existing_key() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("checkpoint.pem");
    let keygen = |force: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_meshca"));
        c.args(["audit", "keygen", "--out"]).arg(&key);
        if force {
            c.arg("--force");
        }
        c.output().unwrap()
    };
    assert!(keygen(false).status.success());
    let first = std::fs::read(&key).unwrap();
    let again = keygen(false);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    assert_eq!(std::fs::read(&key).unwrap(), first, "the key is untouched");
    assert!(keygen(true).status.success());
    assert_ne!(std::fs::read(&key).unwrap(), first);
}

/// A bad flag names the flag, and dev mode reports it before writing any CA
/// material.
#[test]
fn a_bad_flag_is_named_before_any_ca_is_made() {
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args(["serve", "--dev", "--default-ttl", "abc"])
        .env("HOME", home.path())
        .env_remove("XDG_DATA_HOME")
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--default-ttl"), "{stderr}");
    assert!(!stderr.contains("backtrace"), "{stderr}");
    assert_eq!(
        std::fs::read_dir(home.path()).unwrap().count(),
        0,
        "nothing written under HOME"
    );
}

/// `rotate status` with a mistyped directory says so, not `phase: idle`.
#[test]
fn rotate_status_names_a_missing_directory() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    succeeded(
        Command::new(env!("CARGO_BIN_EXE_meshca"))
            .args(["init", "--out"])
            .arg(&ca),
    );
    let missing = dir.path().join("nxt");
    let out = Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args(["rotate", "status", "--ca-dir"])
        .arg(&ca)
        .arg("--rotation-next-dir")
        .arg(&missing)
        .arg("--rotation-state")
        .arg(dir.path().join("state.json"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        stderr.contains("--rotation-next-dir") && stderr.contains("no such directory"),
        "{stderr}"
    );
}
