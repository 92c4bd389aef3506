//! The documentation a newcomer reads stays true to the code: the flag reference is the one the
//! command line generates, and every relative link in the Markdown resolves (file and heading).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// docs/flags.md is exactly what `meshca flags` prints now. A flag added, removed or
/// re-documented without regenerating the file fails here, naming the command that fixes it.
#[test]
fn flag_reference_is_generated_from_the_command_line() {
    let out = Command::new(env!("CARGO_BIN_EXE_meshca"))
        .arg("flags")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "meshca flags: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let generated = String::from_utf8(out.stdout).unwrap();
    let path = repo().join("docs/flags.md");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    if on_disk != generated {
        let line = on_disk
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| on_disk.lines().count().min(generated.lines().count()));
        panic!(
            "docs/flags.md is out of date (first difference at line {}):\n  file:      {:?}\n  generated: {:?}\nregenerate it with `{}`",
            line + 1,
            on_disk.lines().nth(line).unwrap_or("<end of file>"),
            generated.lines().nth(line).unwrap_or("<end of output>"),
            meshca::flags::doc::REGENERATE,
        );
    }
    // Every serve flag is in it, with its variable: the reference is whole.
    for env in [
        "ROOT_CA_DIR",
        "MESHCA_AUDIT_FSYNC",
        "MESHCA_ADMISSION_QUEUE_TARGET",
    ] {
        assert!(generated.contains(&format!("`{env}`")), "{env} missing");
    }
}

/// The Markdown files a reader follows links through.
fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![
        repo().join("README.md"),
        repo().join("ARCHITECTURE.md"),
        repo().join("CHANGELOG.md"),
    ];
    for dir in ["docs", "docs/runbooks"] {
        for entry in std::fs::read_dir(repo().join(dir)).unwrap() {
            let p = entry.unwrap().path();
            if p.extension().is_some_and(|e| e == "md") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

/// Markdown text outside fenced code blocks.
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// GitHub's anchors for a file's headings.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for line in prose(text).lines() {
        let Some(title) = line.strip_prefix('#') else {
            continue;
        };
        let title = title.trim_start_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        // A repeated heading gets -1, -2, ...
        let mut name = slug.clone();
        let mut n = 0;
        while seen.contains(&name) {
            n += 1;
            name = format!("{slug}-{n}");
        }
        seen.insert(name);
    }
    seen
}

/// Every relative link in README, ARCHITECTURE, CHANGELOG and docs/ names a file that exists,
/// and a heading that exists in it when it has a `#fragment`.
#[test]
fn every_relative_link_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let body = prose(&text);
        for link in body.split("](").skip(1).filter_map(|s| s.split(')').next()) {
            let link = link.split_whitespace().next().unwrap_or("");
            if link.is_empty() || link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (target, fragment) = match link.split_once('#') {
                Some((t, f)) => (t, Some(f)),
                None => (link, None),
            };
            let path = if target.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(target)
            };
            let name = file.strip_prefix(repo()).unwrap().display().to_string();
            if !path.exists() {
                broken.push(format!("{name}: {link} (no such file)"));
                continue;
            }
            if let Some(fragment) = fragment {
                if path.is_file()
                    && !anchors(&std::fs::read_to_string(&path).unwrap()).contains(fragment)
                {
                    broken.push(format!("{name}: {link} (no such heading)"));
                }
            }
        }
    }
    assert!(checked > 50, "only {checked} links found");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
