//! The checkpoint key kept in a Kubernetes Secret that meshca creates once,
//! on its first start, instead of a key rendered by Helm (`lookup` +
//! `genPrivateKey` makes a new key on every `helm template`, so Argo CD and
//! Flux would replace it on each sync).
//!
//! Every replica, at start: read the Secret; when it does not exist,
//! generate a P-256 key and create the Secret, immutable; when the create
//! loses to another replica's (409 AlreadyExists), read the winner's. So
//! replicas starting at once end up with one key, and an existing Secret is
//! never replaced: meshca needs `get` on that name and `create` on Secrets,
//! nothing that changes or removes one.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
use kube::api::PostParams;
use kube::{Api, Client};

use super::keys::CheckpointKey;

/// Data key of the PEM in the Secret.
pub const DATA_KEY: &str = "key.pem";
/// Label on a Secret meshca created.
pub const LABEL_CREATED_BY: &str = "audit.meshca.io/created-by";

/// Reading or creating the key Secret failed.
#[derive(Debug, thiserror::Error)]
pub enum KeySecretError {
    #[error("reading checkpoint key Secret {0}: {1}")]
    Read(String, kube::Error),
    #[error("creating checkpoint key Secret {0}: {1}")]
    Create(String, kube::Error),
    /// The Secret exists but holds no usable key: never overwritten, an
    /// operator decides.
    #[error("checkpoint key Secret {0} {1}; meshca never replaces an existing Secret: delete it or fix it")]
    Invalid(String, String),
    #[error("generating a checkpoint key: {0}")]
    Generate(String),
}

impl KeySecretError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Read(..) => "audit_key_secret_read_failed",
            Self::Create(..) => "audit_key_secret_create_failed",
            Self::Invalid(..) => "audit_key_secret_invalid",
            Self::Generate(..) => "audit_key_generate_failed",
        }
    }
}

/// Where the key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyOrigin {
    /// The Secret existed.
    Existing,
    /// This call created it.
    Created,
    /// Another replica created it between our read and our create.
    CreatedByAnother,
}

/// The checkpoint key PEM from `namespace/name`, creating the Secret with a
/// new key when it does not exist.
pub async fn ensure(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<(Vec<u8>, KeyOrigin), KeySecretError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let full = format!("{namespace}/{name}");
    if let Some(s) = api
        .get_opt(name)
        .await
        .map_err(|e| KeySecretError::Read(full.clone(), e))?
    {
        return Ok((pem_of(&full, &s)?, KeyOrigin::Existing));
    }
    let pem = CheckpointKey::generate_pem().map_err(|e| KeySecretError::Generate(e.0))?;
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            labels: Some(BTreeMap::from([(
                LABEL_CREATED_BY.to_string(),
                "meshca".to_string(),
            )])),
            annotations: Some(BTreeMap::from([(
                "audit.meshca.io/note".to_string(),
                "Signs meshca's audit checkpoints. Created once by meshca; back it up. Rotate by giving a new Secret and keeping the old public key for old logs (docs/AUDIT.md).".to_string(),
            )])),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        immutable: Some(true),
        data: Some(BTreeMap::from([(
            DATA_KEY.to_string(),
            ByteString(pem.clone().into_bytes()),
        )])),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok((pem.into_bytes(), KeyOrigin::Created)),
        Err(kube::Error::Api(s)) if s.code == 409 => {
            let s = api
                .get(name)
                .await
                .map_err(|e| KeySecretError::Read(full.clone(), e))?;
            Ok((pem_of(&full, &s)?, KeyOrigin::CreatedByAnother))
        }
        Err(e) => Err(KeySecretError::Create(full, e)),
    }
}

/// The key PEM a Secret holds, checked to load.
fn pem_of(full: &str, s: &Secret) -> Result<Vec<u8>, KeySecretError> {
    let pem = s
        .data
        .as_ref()
        .and_then(|d| d.get(DATA_KEY))
        .map(|b| b.0.clone())
        .ok_or_else(|| KeySecretError::Invalid(full.into(), format!("has no {DATA_KEY}")))?;
    CheckpointKey::from_pem(&pem).map_err(|e| KeySecretError::Invalid(full.into(), e.0))?;
    Ok(pem)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(data: Option<&[u8]>) -> Secret {
        Secret {
            data: data.map(|d| BTreeMap::from([(DATA_KEY.to_string(), ByteString(d.to_vec()))])),
            ..Default::default()
        }
    }

    #[test]
    fn a_secret_is_taken_only_with_a_loadable_key() {
        let pem = CheckpointKey::generate_pem().unwrap();
        assert_eq!(
            pem_of("ns/k", &secret(Some(pem.as_bytes()))).unwrap(),
            pem.as_bytes()
        );
        let e = pem_of("ns/k", &secret(None)).unwrap_err();
        assert_eq!(e.reason(), "audit_key_secret_invalid");
        assert!(e.to_string().contains("has no key.pem"), "{e}");
        let e = pem_of("ns/k", &secret(Some(b"not a key"))).unwrap_err();
        assert_eq!(e.reason(), "audit_key_secret_invalid");
    }
}
