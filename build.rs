// Compiles proto/ with protox (pure Rust), so no system `protoc` is needed,
// and names the commit for meshca_build_info.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    commit();
    let fds = protox::compile(["istio/v1/auth/ca.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}

/// `MESHCA_BUILD_COMMIT` for `meshca_build_info`: the variable when the
/// builder sets it (an image build without `.git`), else `git rev-parse`,
/// else `unknown`. Re-run when HEAD or its branch moves, and only then: a
/// path that does not exist would re-run (and rebuild the crate) every time.
fn commit() {
    println!("cargo:rerun-if-env-changed=MESHCA_BUILD_COMMIT");
    if let Ok(c) = std::env::var("MESHCA_BUILD_COMMIT") {
        println!("cargo:rustc-env=MESHCA_BUILD_COMMIT={c}");
        return;
    }
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    for path in [
        git(&["rev-parse", "--git-path", "HEAD"]),
        git(&["rev-parse", "--symbolic-full-name", "HEAD"])
            .and_then(|r| git(&["rev-parse", "--git-path", &r])),
        git(&["rev-parse", "--git-path", "packed-refs"]),
    ]
    .into_iter()
    .flatten()
    {
        if std::path::Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!("cargo:rustc-env=MESHCA_BUILD_COMMIT={commit}");
}
