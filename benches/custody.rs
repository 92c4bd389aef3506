//! Signing throughput per key custody mode, as ratios to the file key in the
//! same run: the file key (direct), the key in a SoftHSM2 token (direct,
//! every leaf signed by PKCS#11), and two-tier issuing (the token signs one
//! issuing CA, an in-memory key signs the leaves). Each measures the
//! signing step of a request: CSR parse and verify, lifetime, leaf
//! signature, response chain. Modes run interleaved, in rounds, so load from
//! other processes hits all of them alike; the median round is reported.
//!
//! `cargo bench --bench custody` (needs softhsm2: scripts/test installs it).
//! Env: CUSTODY_ROUNDS (5), CUSTODY_SECS per mode and round (2),
//! CUSTODY_THREADS (2), CUSTODY_SESSIONS (PKCS#11 pool, 4).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshca::ca::custody::KeySource;
use meshca::ca::generate::{self, InitOptions, KeyType};
use meshca::ca::{csr, ttl, CaBundle};
use meshca::identity::SpiffeId;
use time::OffsetDateTime;

const ID: &str = "spiffe://cluster.local/ns/bench/sa/bench";

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One request's signing step.
fn sign_one(bundle: &CaBundle, pem: &str, id: &SpiffeId, policy: &ttl::TtlPolicy) {
    let c = csr::parse_and_verify(pem).unwrap();
    let g = ttl::grant(
        OffsetDateTime::now_utc(),
        0,
        policy,
        bundle.signing_not_after(),
        ttl::random_draw(),
    )
    .unwrap();
    let leaf = bundle
        .sign_leaf(&c.spki_der, id, false, &g.validity)
        .unwrap();
    std::hint::black_box(bundle.response_chain(&leaf.pem));
}

/// CSRs per second over `secs` with `threads` signers.
fn rate(bundle: &Arc<CaBundle>, csrs: &Arc<Vec<String>>, threads: u64, secs: u64) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let id: SpiffeId = ID.parse().unwrap();
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (b, c, stop, done, id) = (
                bundle.clone(),
                csrs.clone(),
                stop.clone(),
                done.clone(),
                id.clone(),
            );
            std::thread::spawn(move || {
                let policy = ttl::TtlPolicy::default();
                let mut i = t as usize;
                while !stop.load(Ordering::Relaxed) {
                    sign_one(&b, &c[i % c.len()], &id, &policy);
                    i += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(secs));
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let rounds = env("CUSTODY_ROUNDS", 5);
    let secs = env("CUSTODY_SECS", 2);
    let threads = env("CUSTODY_THREADS", 2);
    let sessions = env("CUSTODY_SESSIONS", 4) as usize;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    std::fs::create_dir(p.join("tokens")).unwrap();
    std::fs::write(
        p.join("softhsm2.conf"),
        format!(
            "directories.tokendir = {}\nobjectstore.backend = file\nlog.level = ERROR\n",
            p.join("tokens").display()
        ),
    )
    .unwrap();
    std::fs::write(p.join("pin"), "1234\n").unwrap();
    // Still single-threaded here, and before the module is loaded (it reads
    // the variable once).
    #[allow(clippy::disallowed_methods)]
    std::env::set_var("SOFTHSM2_CONF", p.join("softhsm2.conf"));
    let out = std::process::Command::new("softhsm2-util")
        .args([
            "--init-token",
            "--free",
            "--label",
            "bench",
            "--so-pin",
            "5678",
            "--pin",
            "1234",
        ])
        .output()
        .expect("softhsm2-util (apt-get install softhsm2)");
    assert!(out.status.success());
    let module = [
        "/usr/lib/softhsm/libsofthsm2.so",
        "/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so",
    ]
    .into_iter()
    .find(|m| std::path::Path::new(m).exists())
    .expect("libsofthsm2.so");
    let uri = format!(
        "pkcs11:token=bench;object=ica?module-path={module}&pin-source=file:{}",
        p.join("pin").display()
    );
    let uri = uri.parse().unwrap();

    // A file root and intermediate (P-256), and a P-256 intermediate in the token under the same root.
    let now = OffsetDateTime::now_utc();
    let opts = InitOptions::default();
    let files = generate::generate(&opts, now).unwrap();
    generate::write_cacerts(&p.join("root"), &files, false).unwrap();
    let file_key = Arc::new(CaBundle::load_dir(&p.join("root"), now).unwrap());
    meshca::ca::custody::init_pkcs11(
        &uri,
        &opts,
        &p.join("hsm"),
        Some(&p.join("root")),
        false,
        now,
    )
    .unwrap();
    let keys = meshca::ca::custody::ExternalKeys::pkcs11(uri, sessions);
    let pkcs11 = Arc::new(
        KeySource::External(Arc::new(keys))
            .load(&p.join("hsm"), now)
            .unwrap(),
    );
    let two_tier = Arc::new(
        meshca::ca::issuing::mint(&pkcs11, Duration::from_secs(24 * 3600), now)
            .unwrap()
            .bundle,
    );
    let csrs: Arc<Vec<String>> = Arc::new(
        (0..64)
            .map(|_| meshca::testing::csr_for(&KeyType::EcdsaP256.generate().unwrap(), ID))
            .collect(),
    );

    let modes: [(&str, &Arc<CaBundle>); 3] = [
        ("file key", &file_key),
        ("pkcs11 direct", &pkcs11),
        ("two-tier (pkcs11 custody)", &two_tier),
    ];
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    for round in 0..rounds {
        let r: Vec<f64> = modes
            .iter()
            .map(|(_, b)| rate(b, &csrs, threads, secs))
            .collect();
        eprintln!(
            "round {round}: {}",
            r.iter()
                .map(|x| format!("{x:.0}"))
                .collect::<Vec<_>>()
                .join(" / ")
        );
        for (i, x) in r.iter().enumerate() {
            results[i].push(*x);
            ratios[i].push(x / r[0]);
        }
    }
    println!(
        "custody signing, {threads} threads, {sessions} PKCS#11 sessions, {rounds} rounds x {secs}s; loadavg before: {}",
        load.trim()
    );
    println!("{:<28} {:>10} {:>16}", "mode", "CSR/s", "ratio to file");
    for (i, (name, _)) in modes.iter().enumerate() {
        println!(
            "{name:<28} {:>10.0} {:>16.3}",
            median(results[i].clone()),
            median(ratios[i].clone())
        );
    }
    println!(
        "loadavg after: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
}
