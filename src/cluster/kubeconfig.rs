//! Remote kubeconfigs come from Secrets that anyone with write access to
//! meshca's namespace can edit: before one is used, it is checked the way
//! istiod checks its remote secrets (istio/istio#36307). An exec plugin or a
//! non-OIDC auth provider runs a command inside meshca's pod, and a file path
//! (client key or certificate, token file, CA file) makes meshca read its own
//! files and send them to a server the Secret names. All are refused unless
//! `PILOT_INSECURE_MULTICLUSTER_KUBECONFIG_OPTIONS` names them. What passes
//! is rebuilt from the fields meshca knows, so a field added to the format
//! later is dropped rather than trusted unseen.

use std::collections::BTreeSet;

use kube::config::{AuthInfo, Cluster, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext};

/// Options `PILOT_INSECURE_MULTICLUSTER_KUBECONFIG_OPTIONS` may name (istiod's
/// spelling), besides auth provider names. `certificateAuthority` is meshca's:
/// istiod lets a CA file through unasked.
pub const OPTIONS: &[&str] = &[
    "exec",
    "clientKey",
    "clientCertificate",
    "tokenFile",
    "certificateAuthority",
];

/// What a remote kubeconfig may use beyond inline credentials.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KubeconfigPolicy {
    /// Entries of [`OPTIONS`] and auth provider names (`gcp`, ...).
    pub allow: BTreeSet<String>,
}

impl KubeconfigPolicy {
    /// Parses the comma-separated allowlist.
    pub fn parse(s: &str) -> Self {
        Self {
            allow: s
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
        }
    }

    fn allows(&self, what: &str) -> bool {
        self.allow.contains(what)
    }
}

/// Why a remote kubeconfig was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KubeconfigError {
    #[error("kubeconfig is empty")]
    Empty,
    #[error("kubeconfig cannot be parsed: {0}")]
    Parse(String),
    #[error("kubeconfig is not usable: {0}")]
    Invalid(String),
    #[error("user {0:?} uses an exec plugin ({1:?}), which is not allowed (PILOT_INSECURE_MULTICLUSTER_KUBECONFIG_OPTIONS lacks \"exec\")")]
    Exec(String, String),
    #[error("user {0:?} uses auth provider {1:?}, which is not allowed")]
    AuthProvider(String, String),
    #[error("{0} {1:?} reads the local file {2:?} ({3}), which is not allowed")]
    FileReference(&'static str, String, String, &'static str),
}

impl KubeconfigError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Empty => "remote_kubeconfig_empty",
            Self::Parse(_) => "remote_kubeconfig_unparsable",
            Self::Invalid(_) => "remote_kubeconfig_invalid",
            Self::Exec(..) => "remote_kubeconfig_exec",
            Self::AuthProvider(..) => "remote_kubeconfig_auth_provider",
            Self::FileReference(..) => "remote_kubeconfig_file_reference",
        }
    }

    /// Every reason, for metrics exported from the start.
    pub const REASONS: &'static [&'static str] = &[
        "remote_kubeconfig_empty",
        "remote_kubeconfig_unparsable",
        "remote_kubeconfig_invalid",
        "remote_kubeconfig_exec",
        "remote_kubeconfig_auth_provider",
        "remote_kubeconfig_file_reference",
    ];
}

fn file_ref(
    kind: &'static str,
    name: &str,
    path: &Option<String>,
    option: &'static str,
    policy: &KubeconfigPolicy,
) -> Result<(), KubeconfigError> {
    match path {
        Some(p) if !p.is_empty() && !policy.allows(option) => Err(KubeconfigError::FileReference(
            kind,
            name.to_string(),
            p.clone(),
            option,
        )),
        _ => Ok(()),
    }
}

fn auth_info(
    name: &str,
    a: &AuthInfo,
    policy: &KubeconfigPolicy,
) -> Result<AuthInfo, KubeconfigError> {
    if let Some(exec) = &a.exec {
        if !policy.allows("exec") {
            return Err(KubeconfigError::Exec(
                name.to_string(),
                exec.command.clone().unwrap_or_default(),
            ));
        }
    }
    if let Some(p) = &a.auth_provider {
        // OIDC reads no file and runs nothing (istiod allows it unasked).
        if p.name != "oidc" && !policy.allows(&p.name) {
            return Err(KubeconfigError::AuthProvider(
                name.to_string(),
                p.name.clone(),
            ));
        }
    }
    file_ref("user", name, &a.client_key, "clientKey", policy)?;
    file_ref(
        "user",
        name,
        &a.client_certificate,
        "clientCertificate",
        policy,
    )?;
    file_ref("user", name, &a.token_file, "tokenFile", policy)?;
    Ok(AuthInfo {
        username: a.username.clone(),
        password: a.password.clone(),
        token: a.token.clone(),
        token_file: a.token_file.clone(),
        client_certificate: a.client_certificate.clone(),
        client_certificate_data: a.client_certificate_data.clone(),
        client_key: a.client_key.clone(),
        client_key_data: a.client_key_data.clone(),
        impersonate: a.impersonate.clone(),
        impersonate_uid: a.impersonate_uid.clone(),
        impersonate_groups: a.impersonate_groups.clone(),
        impersonate_user_extra: a.impersonate_user_extra.clone(),
        auth_provider: a.auth_provider.clone(),
        exec: a.exec.clone(),
        ..Default::default()
    })
}

fn cluster(name: &str, c: &Cluster, policy: &KubeconfigPolicy) -> Result<Cluster, KubeconfigError> {
    file_ref(
        "cluster",
        name,
        &c.certificate_authority,
        "certificateAuthority",
        policy,
    )?;
    Ok(Cluster {
        server: c.server.clone(),
        insecure_skip_tls_verify: c.insecure_skip_tls_verify,
        certificate_authority: c.certificate_authority.clone(),
        certificate_authority_data: c.certificate_authority_data.clone(),
        proxy_url: c.proxy_url.clone(),
        tls_server_name: c.tls_server_name.clone(),
        disable_compression: c.disable_compression,
        ..Default::default()
    })
}

/// Checks and rebuilds one remote kubeconfig. Every user and cluster entry
/// is checked (not only the current context's): a later context switch must
/// not reach an unchecked one. The current context must name a cluster with
/// a server.
pub fn sanitize(raw: &[u8], policy: &KubeconfigPolicy) -> Result<Kubeconfig, KubeconfigError> {
    let text = std::str::from_utf8(raw).map_err(|e| KubeconfigError::Parse(e.to_string()))?;
    if text.trim().is_empty() {
        return Err(KubeconfigError::Empty);
    }
    let kc = Kubeconfig::from_yaml(text).map_err(|e| KubeconfigError::Parse(e.to_string()))?;
    let mut auth_infos = Vec::with_capacity(kc.auth_infos.len());
    for a in &kc.auth_infos {
        let info = match &a.auth_info {
            Some(i) => Some(auth_info(&a.name, i, policy)?),
            None => None,
        };
        auth_infos.push(NamedAuthInfo {
            name: a.name.clone(),
            auth_info: info,
            ..Default::default()
        });
    }
    let mut clusters = Vec::with_capacity(kc.clusters.len());
    for c in &kc.clusters {
        let cl = match &c.cluster {
            Some(x) => Some(cluster(&c.name, x, policy)?),
            None => None,
        };
        clusters.push(NamedCluster {
            name: c.name.clone(),
            cluster: cl,
            ..Default::default()
        });
    }
    let contexts: Vec<NamedContext> = kc
        .contexts
        .iter()
        .map(|c| NamedContext {
            name: c.name.clone(),
            context: c.context.as_ref().map(|x| kube::config::Context {
                cluster: x.cluster.clone(),
                user: x.user.clone(),
                namespace: x.namespace.clone(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    let current = kc
        .current_context
        .clone()
        .filter(|c| !c.is_empty())
        .ok_or_else(|| KubeconfigError::Invalid("no current-context".into()))?;
    let ctx = contexts
        .iter()
        .find(|c| c.name == current)
        .and_then(|c| c.context.as_ref())
        .ok_or_else(|| KubeconfigError::Invalid(format!("context {current:?} not found")))?;
    let has_server = clusters
        .iter()
        .find(|c| c.name == ctx.cluster)
        .and_then(|c| c.cluster.as_ref())
        .and_then(|c| c.server.as_deref())
        .is_some_and(|s| !s.is_empty());
    if !has_server {
        return Err(KubeconfigError::Invalid(format!(
            "context {current:?} names no cluster with a server"
        )));
    }
    Ok(Kubeconfig {
        clusters,
        auth_infos,
        contexts,
        current_context: Some(current),
        kind: Some("Config".into()),
        api_version: Some("v1".into()),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn kc(user: &str, cluster_extra: &str) -> String {
        format!(
            "apiVersion: v1
kind: Config
clusters:
- name: c
  cluster:
    server: https://127.0.0.1:6443
    certificate-authority-data: AAAA
{cluster_extra}
users:
- name: u
  user:
{user}
contexts:
- name: ctx
  context:
    cluster: c
    user: u
current-context: ctx
"
        )
    }

    const EXEC: &str = "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: /bin/sh\n      args: [\"-c\", \"touch /tmp/pwned\"]";

    // (user block, cluster extra, allowlist, refusal reason or "" for accepted)
    #[test_case("    token: abc", "", "", "" ; "inline token")]
    #[test_case("    client-certificate-data: AAAA\n    client-key-data: AAAA", "", "", "" ; "inline client certificate")]
    #[test_case("    username: a\n    password: b", "", "", "" ; "basic auth")]
    #[test_case("    auth-provider:\n      name: oidc\n      config:\n        id-token: x", "", "", "" ; "oidc provider")]
    #[test_case(EXEC, "", "", "remote_kubeconfig_exec" ; "exec plugin")]
    #[test_case(EXEC, "", "exec", "" ; "exec plugin allowed")]
    #[test_case(EXEC, "", "tokenFile,gcp", "remote_kubeconfig_exec" ; "exec not in the allowlist")]
    #[test_case("    auth-provider:\n      name: gcp\n      config:\n        cmd-path: /bin/sh", "", "", "remote_kubeconfig_auth_provider" ; "gcp provider runs a command")]
    #[test_case("    auth-provider:\n      name: gcp\n      config: {}", "", "gcp", "" ; "gcp provider allowed")]
    #[test_case("    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token", "", "", "remote_kubeconfig_file_reference" ; "token file")]
    #[test_case("    tokenFile: /t", "", "tokenFile", "" ; "token file allowed")]
    #[test_case("    client-key: /etc/key.pem\n    client-certificate-data: AAAA", "", "", "remote_kubeconfig_file_reference" ; "client key file")]
    #[test_case("    client-certificate: /etc/c.pem\n    client-key-data: AAAA", "", "clientKey", "remote_kubeconfig_file_reference" ; "client certificate file")]
    #[test_case("    token: abc", "    certificate-authority: /etc/ca.pem", "", "remote_kubeconfig_file_reference" ; "ca file")]
    #[test_case("    token: abc", "    certificate-authority: /etc/ca.pem", "certificateAuthority", "" ; "ca file allowed")]
    fn table(user: &str, cluster_extra: &str, allow: &str, want: &str) {
        let got = sanitize(
            kc(user, cluster_extra).as_bytes(),
            &KubeconfigPolicy::parse(allow),
        );
        match got {
            Ok(_) => assert_eq!(want, "", "accepted"),
            Err(e) => assert_eq!(e.reason(), want, "{e}"),
        }
    }

    #[test]
    fn every_user_is_checked_not_only_the_current_one() {
        let mut text = kc("    token: abc", "");
        text.push_str("# another user\n");
        let text = text.replace(
            "contexts:",
            &format!("- name: other\n  user:\n{EXEC}\ncontexts:"),
        );
        let e = sanitize(text.as_bytes(), &KubeconfigPolicy::default()).unwrap_err();
        assert_eq!(e.reason(), "remote_kubeconfig_exec");
        assert!(e.to_string().contains("\"other\""), "{e}");
    }

    #[test_case("", "remote_kubeconfig_empty" ; "empty")]
    #[test_case("{{{", "remote_kubeconfig_unparsable" ; "not yaml")]
    #[test_case("apiVersion: v1\nkind: Config\nclusters: []\nusers: []\ncontexts: []\n", "remote_kubeconfig_invalid" ; "no current context")]
    #[test_case("apiVersion: v1\nkind: Config\nclusters: []\nusers: []\ncontexts:\n- name: x\n  context:\n    cluster: nope\ncurrent-context: x\n", "remote_kubeconfig_invalid" ; "context names no cluster")]
    fn malformed(text: &str, want: &str) {
        let e = sanitize(text.as_bytes(), &KubeconfigPolicy::default()).unwrap_err();
        assert_eq!(e.reason(), want, "{e}");
    }

    #[test]
    fn unknown_fields_are_dropped() {
        let text = kc(
            "    token: abc\n    extensions:\n    - name: x\n      extension: {a: 1}",
            "    extensions:\n    - name: y\n      extension: {}",
        );
        let out = sanitize(text.as_bytes(), &KubeconfigPolicy::default()).unwrap();
        let user = out.auth_infos[0].auth_info.as_ref().unwrap();
        assert!(user.extensions.is_none() && user.other.is_empty());
        assert!(out.clusters[0]
            .cluster
            .as_ref()
            .unwrap()
            .extensions
            .is_none());
        assert_eq!(out.current_context.as_deref(), Some("ctx"));
    }
}
