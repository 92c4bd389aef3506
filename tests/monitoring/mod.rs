//! What the chart's alerts and dashboard ask of meshca's /metrics, read from
//! the chart itself: the PrometheusRule as the real helm renders it, the
//! dashboard JSON, and the metric selectors of every PromQL expression in
//! them. Shared by tests/alerts.rs (promtool) and tests/metrics_contract.rs
//! (a live scrape).
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_yaml_ng::Value;

pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn cache() -> PathBuf {
    std::env::var_os("MESHCA_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/meshca")
        })
}

/// helm from $MESHCA_HELM, else the cache scripts/chart-test builds into.
pub fn helm() -> PathBuf {
    let path = std::env::var_os("MESHCA_HELM")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache().join("bin/helm"));
    assert!(
        path.is_file(),
        "{} not found: these tests need helm. Run ./scripts/test, or scripts/chart-test KTE_DIR (builds it), or set MESHCA_HELM",
        path.display()
    );
    path
}

/// promtool from $MESHCA_PROMTOOL, else built (or found cached) by scripts/promtool.
pub fn promtool() -> PathBuf {
    if let Some(p) = std::env::var_os("MESHCA_PROMTOOL") {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "MESHCA_PROMTOOL={} is not a file", p.display());
        return p;
    }
    let out = Command::new(repo().join("scripts/promtool"))
        .output()
        .expect("running scripts/promtool");
    assert!(
        out.status.success(),
        "scripts/promtool failed (it builds promtool from tools/promtool/go.mod; needs Go):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// `helm template` of one template; the YAML documents (none when the template renders nothing).
pub fn render(template: &str, flags: &[&str]) -> Vec<Value> {
    let out = Command::new(helm())
        .args(["template", "meshca"])
        .arg(repo().join("charts/meshca"))
        .args(["--namespace", "istio-system", "--show-only", template])
        .args(flags)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // helm refuses --show-only for a template that renders nothing.
    if !out.status.success() && stderr.contains("could not find template") {
        return Vec::new();
    }
    assert!(
        out.status.success(),
        "helm template {template} {flags:?} failed: {stderr}"
    );
    serde_yaml_ng::Deserializer::from_str(&String::from_utf8(out.stdout).unwrap())
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// The PrometheusRule's `spec` (a Prometheus rules file) rendered with `flags`.
pub fn rules_spec(flags: &[&str]) -> Value {
    let mut all = vec!["--set", "alerts.enabled=true"];
    all.extend_from_slice(flags);
    let docs = render("templates/prometheusrule.yaml", &all);
    assert_eq!(docs.len(), 1, "one PrometheusRule");
    assert_eq!(docs[0]["kind"].as_str(), Some("PrometheusRule"));
    docs[0]["spec"].clone()
}

/// One alerting rule of the rendered spec.
#[derive(Debug, Clone)]
pub struct AlertRule {
    pub alert: String,
    pub expr: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

fn string_map(v: &Value) -> BTreeMap<String, String> {
    v.as_mapping()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let v = match v {
                        Value::String(s) => s.clone(),
                        other => serde_yaml_ng::to_string(other).unwrap().trim().to_string(),
                    };
                    (k.as_str().unwrap().to_string(), v)
                })
                .collect()
        })
        .unwrap_or_default()
}

pub fn alert_rules(spec: &Value) -> Vec<AlertRule> {
    spec["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_sequence().unwrap().clone())
        .map(|r| AlertRule {
            alert: r["alert"]
                .as_str()
                .expect("only alerting rules")
                .to_string(),
            expr: r["expr"].as_str().unwrap().to_string(),
            labels: string_map(&r["labels"]),
            annotations: string_map(&r["annotations"]),
        })
        .collect()
}

/// The dashboard the chart ships (`charts/meshca/dashboards/meshca.json`).
pub fn dashboard() -> serde_json::Value {
    let text =
        std::fs::read_to_string(repo().join("charts/meshca/dashboards/meshca.json")).unwrap();
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every panel query of the dashboard as (panel title, expr), with Grafana's
/// variables replaced by what Grafana sends Prometheus in their place.
pub fn dashboard_exprs(d: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut panels: Vec<&serde_json::Value> = d["panels"].as_array().unwrap().iter().collect();
    while let Some(p) = panels.pop() {
        if let Some(inner) = p["panels"].as_array() {
            panels.extend(inner.iter());
        }
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {} has a target without expr", p["title"]));
            out.push((
                p["title"].as_str().unwrap().to_string(),
                grafana_interpolate(expr),
            ));
        }
    }
    out
}

/// Grafana's built-in and dashboard variables, as Grafana substitutes them.
pub fn grafana_interpolate(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__range", "6h")
        .replace("$__interval", "30s")
        .replace("\"$job\"", "\".+\"")
        .replace("\"$namespace\"", "\".+\"")
        .replace("\"$pod\"", "\".+\"")
}

/// Series Prometheus makes itself for each target (never in /metrics).
pub const SCRAPE_SERIES: &[&str] = &["up"];

/// Labels Prometheus attaches when it scrapes (never in /metrics itself).
pub const TARGET_LABELS: &[&str] = &[
    "job",
    "instance",
    "namespace",
    "pod",
    "service",
    "endpoint",
    "container",
];

/// A label matcher of a selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    pub label: String,
    pub op: String,
    pub value: String,
}

/// A metric selector: `name{matchers}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    pub metric: String,
    pub matchers: Vec<Matcher>,
}

/// What one expression uses: its metric selectors, and the labels it groups
/// or matches by (`by`, `without`, `on`, `ignoring`, `group_left/right`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Uses {
    pub selectors: Vec<Selector>,
    pub grouping: BTreeSet<String>,
}

/// Keywords that take a list of labels: `by (..)`, `on (..)`, ...
const TAKES_LABELS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
/// The other keywords (not metric names).
const KEYWORDS: &[&str] = &["and", "or", "unless", "bool", "offset", "atan2"];

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    Num,
    Punct(char),
    Op(String),
}

fn tokens(expr: &str) -> Result<Vec<Tok>, String> {
    let c: Vec<char> = expr.chars().collect();
    let mut i = 0;
    let mut out = Vec::new();
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '#' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch.is_ascii_alphabetic() || ch == '_' || ch == ':' {
            let s = i;
            while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '_' || c[i] == ':') {
                i += 1;
            }
            out.push(Tok::Ident(c[s..i].iter().collect()));
        } else if ch.is_ascii_digit()
            || (ch == '.' && c.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '.') {
                i += 1;
            }
            out.push(Tok::Num);
        } else if ch == '"' || ch == '\'' || ch == '`' {
            let q = ch;
            i += 1;
            let mut s = String::new();
            while i < c.len() && c[i] != q {
                if c[i] == '\\' && q != '`' {
                    i += 1;
                }
                if i < c.len() {
                    s.push(c[i]);
                }
                i += 1;
            }
            if i >= c.len() {
                return Err(format!("unterminated string in {expr}"));
            }
            i += 1;
            out.push(Tok::Str(s));
        } else if "=!<>".contains(ch) {
            let s = i;
            i += 1;
            if i < c.len() && (c[i] == '=' || c[i] == '~') {
                i += 1;
            }
            out.push(Tok::Op(c[s..i].iter().collect()));
        } else {
            out.push(Tok::Punct(ch));
            i += 1;
        }
    }
    Ok(out)
}

/// The metric selectors and grouping labels of a PromQL expression. Not a
/// full parser (promtool parses every expression for real); enough to name
/// what the expression reads.
pub fn uses(expr: &str) -> Result<Uses, String> {
    let t = tokens(expr)?;
    let mut u = Uses::default();
    let mut i = 0;
    while i < t.len() {
        match &t[i] {
            Tok::Punct('[') => {
                while i < t.len() && t[i] != Tok::Punct(']') {
                    i += 1;
                }
                i += 1;
            }
            Tok::Ident(id)
                if KEYWORDS.contains(&id.as_str()) || TAKES_LABELS.contains(&id.as_str()) =>
            {
                i += 1;
                if id == "offset" {
                    i += 1; // its duration
                } else if TAKES_LABELS.contains(&id.as_str()) && t.get(i) == Some(&Tok::Punct('('))
                {
                    i += 1;
                    while i < t.len() && t[i] != Tok::Punct(')') {
                        if let Tok::Ident(l) = &t[i] {
                            u.grouping.insert(l.clone());
                        }
                        i += 1;
                    }
                    i += 1;
                }
            }
            Tok::Ident(_) if t.get(i + 1) == Some(&Tok::Punct('(')) => i += 1, // a function
            Tok::Ident(_) if matches!(t.get(i + 1), Some(Tok::Ident(k)) if k == "by" || k == "without") => {
                i += 1
            } // sum by (..) (..)
            Tok::Ident(name) => {
                let mut sel = Selector {
                    metric: name.clone(),
                    matchers: Vec::new(),
                };
                i += 1;
                if t.get(i) == Some(&Tok::Punct('{')) {
                    i += 1;
                    while i < t.len() && t[i] != Tok::Punct('}') {
                        match (&t[i], t.get(i + 1), t.get(i + 2)) {
                            (Tok::Ident(l), Some(Tok::Op(op)), Some(Tok::Str(v))) => {
                                sel.matchers.push(Matcher {
                                    label: l.clone(),
                                    op: op.clone(),
                                    value: v.clone(),
                                });
                                i += 3;
                            }
                            (Tok::Punct(','), ..) => i += 1,
                            other => {
                                return Err(format!(
                                    "cannot read the matchers of {name} in {expr}: {other:?}"
                                ))
                            }
                        }
                    }
                    i += 1;
                }
                u.selectors.push(sel);
            }
            Tok::Punct('{') => return Err(format!("a selector without a metric name in {expr}")),
            _ => i += 1,
        }
    }
    Ok(u)
}

/// A sample of a scrape: name and labels.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
}

/// The samples of a Prometheus text exposition (comments skipped).
pub fn parse_scrape(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, rest) = match line.find('{') {
            Some(b) if line[..b].find(' ').is_none() => (&line[..b], &line[b..]),
            _ => (line.split(' ').next().unwrap(), ""),
        };
        let mut labels = BTreeMap::new();
        if let Some(body) = rest
            .strip_prefix('{')
            .and_then(|r| r.split_once('}'))
            .map(|(b, _)| b)
        {
            for (k, v) in tokens(body).unwrap().chunks(4).filter_map(|c| match c {
                [Tok::Ident(k), Tok::Op(_), Tok::Str(v), ..] => Some((k.clone(), v.clone())),
                _ => None,
            }) {
                labels.insert(k, v);
            }
        }
        out.push(Sample {
            name: name.to_string(),
            labels,
        });
    }
    out
}

/// One thing an expression needs from /metrics.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Need {
    /// Samples of this metric.
    Metric(String),
    /// This label on the metric's samples.
    Label(String, String),
    /// This label value (a `=` matcher, or a literal alternative of `=~`).
    Value(String, String, String),
    /// A value with this prefix (a `prefix.*` alternative of `=~`).
    Prefix(String, String, String),
    /// A label an aggregation or vector match uses: on at least one of the metrics.
    Grouping(Vec<String>, String),
}

impl std::fmt::Display for Need {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Need::Metric(m) => write!(f, "metric {m}"),
            Need::Label(m, l) => write!(f, "label {l} on {m}"),
            Need::Value(m, l, v) => write!(f, "{m}{{{l}=\"{v}\"}}"),
            Need::Prefix(m, l, p) => write!(f, "{m}{{{l}=~\"{p}.*\"}}"),
            Need::Grouping(ms, l) => write!(f, "label {l} (grouping) on one of {ms:?}"),
        }
    }
}

/// What an expression needs. Regex matchers must be alternations of
/// literals or `prefix.*`, so every value they mean can be checked.
pub fn needs(expr: &str) -> Result<BTreeSet<Need>, String> {
    let u = uses(expr)?;
    let mut out = BTreeSet::new();
    for s in &u.selectors {
        if SCRAPE_SERIES.contains(&s.metric.as_str()) {
            continue;
        }
        out.insert(Need::Metric(s.metric.clone()));
        for m in &s.matchers {
            if TARGET_LABELS.contains(&m.label.as_str()) {
                continue;
            }
            out.insert(Need::Label(s.metric.clone(), m.label.clone()));
            match m.op.as_str() {
                "=" => {
                    out.insert(Need::Value(
                        s.metric.clone(),
                        m.label.clone(),
                        m.value.clone(),
                    ));
                }
                "=~" => {
                    for alt in m.value.split('|') {
                        if let Some(p) = alt.strip_suffix(".*") {
                            if p.chars().any(|c| !(c.is_ascii_alphanumeric() || c == '_')) {
                                return Err(format!("regex alternative {alt:?} in {expr} is neither a literal nor prefix.*"));
                            }
                            out.insert(Need::Prefix(
                                s.metric.clone(),
                                m.label.clone(),
                                p.to_string(),
                            ));
                        } else if alt
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '+' || c == '.')
                        {
                            out.insert(Need::Value(
                                s.metric.clone(),
                                m.label.clone(),
                                alt.to_string(),
                            ));
                        } else {
                            return Err(format!("regex alternative {alt:?} in {expr} is neither a literal nor prefix.*"));
                        }
                    }
                }
                // Negative matchers exclude values: that they exist is not needed.
                _ => {}
            }
        }
    }
    let metrics: Vec<String> = u.selectors.iter().map(|s| s.metric.clone()).collect();
    for l in &u.grouping {
        if !TARGET_LABELS.contains(&l.as_str()) {
            out.insert(Need::Grouping(metrics.clone(), l.clone()));
        }
    }
    Ok(out)
}

/// Whether `samples` satisfy `need`.
pub fn satisfied(need: &Need, samples: &[Sample]) -> bool {
    fn of<'a>(samples: &'a [Sample], m: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        samples.iter().filter(move |s| s.name == m)
    }
    match need {
        Need::Metric(m) => of(samples, m).next().is_some(),
        Need::Label(m, l) => of(samples, m).any(|s| s.labels.contains_key(l)),
        Need::Value(m, l, v) => of(samples, m).any(|s| s.labels.get(l) == Some(v)),
        Need::Prefix(m, l, p) => {
            of(samples, m).any(|s| s.labels.get(l).is_some_and(|v| v.starts_with(p.as_str())))
        }
        Need::Grouping(ms, l) => ms
            .iter()
            .any(|m| of(samples, m).any(|s| s.labels.contains_key(l))),
    }
}

/// Every expression of the rendered alerts (default thresholds) and the dashboard, by source.
pub fn all_exprs() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = alert_rules(&rules_spec(&[]))
        .into_iter()
        .map(|r| (format!("alert {}", r.alert), r.expr))
        .collect();
    out.extend(
        dashboard_exprs(&dashboard())
            .into_iter()
            .map(|(t, e)| (format!("panel {t:?}"), e)),
    );
    out
}

/// Every need of every expression, with the expressions that need it.
pub fn all_needs() -> BTreeMap<Need, Vec<String>> {
    let mut out: BTreeMap<Need, Vec<String>> = BTreeMap::new();
    for (src, expr) in all_exprs() {
        for n in needs(&expr).unwrap_or_else(|e| panic!("{src}: {e}")) {
            out.entry(n).or_default().push(src.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_and_grouping_are_read() {
        let u = uses(
            r#"sum without (decision, reason) (rate(meshca_decisions_total{decision="deny",reason!~"a|b"}[10m]))
              / sum by (le) (rate(x_bucket[5m] offset 1h)) > 0.5 and on (node) y
              or (z unless z offset 10m)"#,
        )
        .unwrap();
        assert_eq!(
            u.selectors
                .iter()
                .map(|s| s.metric.as_str())
                .collect::<Vec<_>>(),
            ["meshca_decisions_total", "x_bucket", "y", "z", "z"]
        );
        assert_eq!(u.selectors[0].matchers.len(), 2);
        assert_eq!(
            u.grouping.iter().map(String::as_str).collect::<Vec<_>>(),
            ["decision", "le", "node", "reason"]
        );
    }

    #[test]
    fn regex_values_must_be_checkable() {
        let n = needs(r#"m{reason=~"admission_.*|audit_queue_full"}"#).unwrap();
        assert!(n.contains(&Need::Prefix(
            "m".into(),
            "reason".into(),
            "admission_".into()
        )));
        assert!(n.contains(&Need::Value(
            "m".into(),
            "reason".into(),
            "audit_queue_full".into()
        )));
        assert!(needs(r#"m{reason=~"a[bc]"}"#).is_err());
    }

    #[test]
    fn scrape_lines_are_read() {
        let s = parse_scrape("# HELP x y\nm_total{a=\"1\",b=\"x y\"} 3\nn 4\n");
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].labels["b"], "x y");
        assert!(satisfied(
            &Need::Value("m_total".into(), "a".into(), "1".into()),
            &s
        ));
        assert!(!satisfied(&Need::Label("n".into(), "a".into()), &s));
    }
}
