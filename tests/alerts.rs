//! The chart's alerts and dashboard against Prometheus's own tools: the
//! PrometheusRule as helm renders it must pass `promtool check rules` and the
//! rule unit tests in tests/alerts/ (one firing and one quiet case per
//! alert), every dashboard query must parse (as a recording rule, which
//! promtool parses with Prometheus's PromQL parser), and every runbook_url
//! must name a page that exists in this repository.
//!
//! promtool comes from $MESHCA_PROMTOOL or scripts/promtool (built from the
//! Go module proxy, pinned in tools/promtool/go.mod, cached); helm as in
//! tests/chart.rs.
#![allow(clippy::unwrap_used)]

mod monitoring;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use monitoring::{alert_rules, dashboard, dashboard_exprs, promtool, repo, rules_spec};
use serde_yaml_ng::Value;

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

fn write_rules(dir: &Path, spec: &Value) -> std::path::PathBuf {
    let path = dir.join("rules.yaml");
    std::fs::write(&path, serde_yaml_ng::to_string(spec).unwrap()).unwrap();
    path
}

#[test]
fn promtool_checks_the_rendered_rules() {
    let dir = tempfile::tempdir().unwrap();
    // Default thresholds, and every threshold changed (ci-values.yaml).
    for flags in [vec![], vec!["-f", "charts/meshca/ci-values.yaml"]] {
        let flags: Vec<String> = flags
            .iter()
            .map(|f| {
                if f.ends_with(".yaml") {
                    repo().join(f).display().to_string()
                } else {
                    f.to_string()
                }
            })
            .collect();
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let spec = rules_spec(&flags);
        let rules = write_rules(dir.path(), &spec);
        let out = run(Command::new(promtool())
            .args(["check", "rules"])
            .arg(&rules));
        let n = alert_rules(&spec).len();
        assert!(
            out.contains(&format!("SUCCESS: {n} rules found")),
            "{flags:?}: {out}"
        );
    }
}

/// The unit tests pass, and cover every alert: a case where it fires, and a
/// quiet one (a case expecting no alert, or an input series of the same
/// test whose pod, node, cluster or reason the firing alerts do not carry).
#[test]
fn promtool_rule_unit_tests_fire_and_stay_quiet_for_every_alert() {
    let dir = tempfile::tempdir().unwrap();
    write_rules(dir.path(), &rules_spec(&[]));
    let tests = std::fs::read_to_string(repo().join("tests/alerts/meshca.test.yaml")).unwrap();
    std::fs::write(dir.path().join("meshca.test.yaml"), &tests).unwrap();
    let out = run(Command::new(promtool()).current_dir(dir.path()).args([
        "test",
        "rules",
        "meshca.test.yaml",
    ]));
    assert!(out.contains("SUCCESS"), "{out}");

    let doc: Value = serde_yaml_ng::from_str(&tests).unwrap();
    let alerts: BTreeSet<String> = alert_rules(&rules_spec(&[]))
        .into_iter()
        .map(|r| r.alert)
        .collect();
    let ident = ["pod", "node", "cluster", "reason"];
    let (mut firing, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    for t in doc["tests"].as_sequence().unwrap() {
        let series: Vec<BTreeMap<String, String>> = t["input_series"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|s| {
                monitoring::parse_scrape(&format!("{} 0", s["series"].as_str().unwrap()))
                    .remove(0)
                    .labels
            })
            .collect();
        for case in t["alert_rule_test"].as_sequence().unwrap() {
            let name = case["alertname"].as_str().unwrap().to_string();
            assert!(alerts.contains(&name), "test for unknown alert {name}");
            let exp = case["exp_alerts"]
                .as_sequence()
                .cloned()
                .unwrap_or_default();
            if exp.is_empty() {
                quiet.insert(name);
                continue;
            }
            firing.insert(name.clone());
            let fired: Vec<BTreeMap<String, String>> = exp
                .iter()
                .map(|e| serde_yaml_ng::from_value(e["exp_labels"].clone()).unwrap())
                .collect();
            let key = |l: &BTreeMap<String, String>| -> Vec<Option<String>> {
                ident.iter().map(|k| l.get(*k).cloned()).collect()
            };
            let fired_keys: BTreeSet<_> = fired.iter().map(&key).collect();
            if series.iter().any(|s| {
                let k = key(s);
                // A series of another pod/node/cluster/reason than every alert that fired.
                !fired_keys
                    .iter()
                    .any(|f| f.iter().zip(&k).all(|(f, s)| f.is_none() || f == s))
            }) {
                quiet.insert(name);
            }
        }
    }
    let missing_firing: Vec<_> = alerts.difference(&firing).collect();
    let missing_quiet: Vec<_> = alerts.difference(&quiet).collect();
    assert!(
        missing_firing.is_empty(),
        "alerts no test fires: {missing_firing:?}"
    );
    assert!(
        missing_quiet.is_empty(),
        "alerts without a quiet case: {missing_quiet:?}"
    );
}

/// Every panel query parses: each becomes a recording rule of a rules file
/// that `promtool check rules` parses with Prometheus's own PromQL parser.
#[test]
fn every_dashboard_query_parses() {
    let d = dashboard();
    let exprs = dashboard_exprs(&d);
    assert!(exprs.len() >= 20, "{} queries", exprs.len());
    let rules: Vec<Value> = exprs
        .iter()
        .enumerate()
        .map(|(i, (_, e))| {
            serde_yaml_ng::to_value(BTreeMap::from([
                ("record".to_string(), format!("meshca_dashboard:query_{i}")),
                ("expr".to_string(), e.clone()),
            ]))
            .unwrap()
        })
        .collect();
    let file = serde_yaml_ng::to_value(BTreeMap::from([(
        "groups",
        vec![BTreeMap::from([
            ("name", Value::from("dashboard")),
            ("rules", Value::Sequence(rules)),
        ])],
    )]))
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = write_rules(dir.path(), &file);
    let out = run(Command::new(promtool()).args(["check", "rules"]).arg(&path));
    assert!(
        out.contains(&format!("SUCCESS: {} rules found", exprs.len())),
        "{out}"
    );

    // The check can fail: a query with a PromQL error is refused.
    let broken = serde_yaml_ng::to_value(BTreeMap::from([(
        "groups",
        vec![BTreeMap::from([
            ("name", Value::from("dashboard")),
            (
                "rules",
                serde_yaml_ng::to_value(vec![BTreeMap::from([
                    ("record", "meshca_dashboard:broken"),
                    ("expr", "sum by (reason (rate(meshca_decisions_total[5m]))"),
                ])])
                .unwrap(),
            ),
        ])],
    )]))
    .unwrap();
    let path = write_rules(dir.path(), &broken);
    let out = Command::new(promtool())
        .args(["check", "rules"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success(), "promtool accepted a broken query");

    // Panels: unique ids, a Prometheus datasource from the dashboard's variable, queries.
    let mut ids = BTreeSet::new();
    for p in d["panels"].as_array().unwrap() {
        assert!(
            ids.insert(p["id"].as_i64().unwrap()),
            "duplicate panel id {}",
            p["id"]
        );
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        assert!(
            !p["targets"].as_array().unwrap().is_empty(),
            "{}",
            p["title"]
        );
        assert!(
            p["description"].as_str().is_some_and(|s| !s.is_empty()),
            "{}",
            p["title"]
        );
    }
}

/// The panels the dashboard must have (titles), each with at least one query.
#[test]
fn dashboard_has_the_panels_operators_need() {
    let exprs = dashboard_exprs(&dashboard());
    let titles: BTreeSet<&str> = exprs.iter().map(|(t, _)| t.as_str()).collect();
    for (title, metric) in [
        ("Certificates issued and refused", "meshca_decisions_total"),
        ("Latency", "meshca_request_duration_seconds_bucket"),
        ("Decisions by reason", "meshca_decisions_total"),
        ("Sheds", "meshca_admission_shed_total"),
        ("TokenReview budget use", "meshca_tokenreviews_total"),
        ("Pod index size", "meshca_pod_index_pods"),
        ("Pod index sync", "meshca_pod_index_synced"),
        (
            "CA and root expiry",
            "meshca_root_cert_expiry_timestamp_seconds",
        ),
        ("Rotation phase", "meshca_rotation_phase"),
        ("Audit health", "meshca_audit_write_errors_total"),
        ("Refusals per node", "meshca_node_refusals_total"),
        (
            "Denylist hits and revoked certificates",
            "meshca_denylist_hits_total",
        ),
        ("Token verification failures", "meshca_decisions_total"),
        ("Ready replicas", "meshca_ready"),
        (
            "Days to signing CA expiry",
            "meshca_ca_cert_expiry_timestamp_seconds",
        ),
        (
            "Days to root expiry",
            "meshca_root_cert_expiry_timestamp_seconds",
        ),
        ("Process CPU", "process_cpu_seconds_total"),
        ("Process memory", "process_resident_memory_bytes"),
    ] {
        assert!(titles.contains(title), "no panel {title:?}");
        assert!(
            exprs.iter().any(|(t, e)| t == title && e.contains(metric)),
            "panel {title:?} does not query {metric}"
        );
    }
    // Every query follows the job, namespace and pod variables (as written,
    // before Grafana interpolates them).
    let d = dashboard();
    for p in d["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let e = t["expr"].as_str().unwrap_or_default();
            assert!(
                e.contains(r#"job=~"$job",namespace=~"$namespace",pod=~"$pod""#),
                "panel {} ignores the job, namespace or pod variable: {e}",
                p["title"]
            );
        }
    }
    // The security signals are per node.
    assert!(exprs
        .iter()
        .any(|(t, e)| t == "Refusals per node" && e.contains("by (node")));
}

/// Every runbook_url names a page of docs/runbooks/ that exists, under the
/// configured base; every page belongs to an alert and says what the alert
/// means, how to confirm it with `meshca audit query`, and what to do; the
/// security alerts link the compromised-node runbook.
#[test]
fn every_runbook_url_resolves_to_a_page_in_the_repo() {
    let base = "https://git.example.com/mesh/meshca/-/blob/v1/";
    let spec = rules_spec(&["--set", &format!("alerts.runbookBaseURL={base}")]);
    let rules = alert_rules(&spec);
    assert!(rules.len() >= 20, "{} rules", rules.len());
    let mut pages = BTreeSet::new();
    for r in &rules {
        let url = r
            .annotations
            .get("runbook_url")
            .unwrap_or_else(|| panic!("{} has no runbook_url", r.alert));
        let path = url
            .strip_prefix(base)
            .unwrap_or_else(|| panic!("{}: {url} is not under {base}", r.alert));
        assert_eq!(
            path,
            format!("docs/runbooks/{}.md", r.alert),
            "one page per alert, named for it"
        );
        assert!(
            repo().join(path).is_file(),
            "{}: {path} does not exist",
            r.alert
        );
        pages.insert(path.to_string());
        for k in ["summary", "description"] {
            assert!(r.annotations.contains_key(k), "{}: no {k}", r.alert);
        }
        for k in ["severity", "category"] {
            assert!(r.labels.contains_key(k), "{}: no {k} label", r.alert);
        }
        if r.labels["category"] == "security" {
            let node = r
                .annotations
                .get("compromised_node_runbook")
                .unwrap_or_else(|| panic!("{}: no compromised-node runbook link", r.alert));
            assert_eq!(node, &format!("{base}docs/RUNBOOK-compromised-node.md"));
            assert!(repo().join("docs/RUNBOOK-compromised-node.md").is_file());
            let text = std::fs::read_to_string(repo().join(path)).unwrap();
            assert!(
                text.contains("../RUNBOOK-compromised-node.md"),
                "{path} does not link the compromised-node runbook"
            );
        }
    }
    for entry in std::fs::read_dir(repo().join("docs/runbooks")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let path = format!("docs/runbooks/{name}");
        if name == "README.md" {
            continue;
        }
        assert!(pages.contains(&path), "{path} belongs to no alert");
        let text = std::fs::read_to_string(repo().join(&path)).unwrap();
        for heading in ["## What it means", "## Confirm", "## What to do"] {
            assert!(text.contains(heading), "{path}: no {heading:?}");
        }
        assert!(
            text.contains("meshca audit query") || text.contains("meshca audit verify"),
            "{path}: no audit command to confirm it"
        );
        // Relative links between runbooks resolve too.
        for link in text.split("](").skip(1).filter_map(|s| s.split(')').next()) {
            if link.starts_with("http") || link.starts_with('#') {
                continue;
            }
            let target = link.split('#').next().unwrap();
            assert!(
                repo().join("docs/runbooks").join(target).exists(),
                "{path}: broken link {link}"
            );
        }
    }
}
