//! Where revocations are kept: one JSON object per line, in a file
//! (`MESHCA_REVOCATION_FILE`, for `serve --dev` and runs without a cluster)
//! or in a ConfigMap every replica reads (`MESHCA_REVOCATION_CONFIGMAP`,
//! key `revocations`). `meshca revoke` appends; the server only reads.
//! Entries are never rewritten: lifting a revocation appends an
//! un-revocation; the only removal a writer makes is pruning entries of
//! certificates that expired more than [`PRUNE_AFTER`] ago (ConfigMaps hold
//! at most 1 MiB).

use std::io::Write as _;
use std::path::Path;

use time::OffsetDateTime;

use super::ledger::{Ledger, SourceRead, StoreSource};
use super::{Revocation, RevocationError};

/// Data key of the revocations in their ConfigMap.
pub const CONFIGMAP_KEY: &str = "revocations";

/// How long after its certificate's expiry a writer may drop an entry.
/// Readers accept any removal of an expired certificate's entry; the
/// margin covers clocks that disagree.
pub const PRUNE_AFTER: time::Duration = time::Duration::hours(1);

/// Parses the store's text; any line that is not an entry is an error
/// (never silently drop a revocation).
pub fn parse_store(text: &str) -> Result<Vec<Revocation>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str::<Revocation>(l).map_err(|e| format!("line {}: {e}", i + 1))
        })
        .collect()
}

/// The store's text for `entries`.
pub fn render_store(entries: &[Revocation]) -> Result<String, String> {
    let mut buf = String::new();
    for e in entries {
        buf.push_str(&serde_json::to_string(e).map_err(|e| e.to_string())?);
        buf.push('\n');
    }
    Ok(buf)
}

/// Reads the file store; a missing file is an empty store. Unreadable
/// lines are an error.
pub fn read_store(path: &Path) -> Result<Vec<Revocation>, RevocationError> {
    match read_file(path) {
        SourceRead::Entries(e) => Ok(e),
        SourceRead::Missing => Ok(Vec::new()),
        SourceRead::Unreadable(detail) => Err(RevocationError::Store {
            path: path.display().to_string(),
            detail,
        }),
    }
}

/// One read of the file store.
pub fn read_file(path: &Path) -> SourceRead {
    match std::fs::read_to_string(path) {
        Ok(t) => match parse_store(&t) {
            Ok(e) => SourceRead::Entries(e),
            Err(e) => SourceRead::Unreadable(e),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => SourceRead::Missing,
        Err(e) => SourceRead::Unreadable(e.to_string()),
    }
}

/// Appends entries durably (fsync) to the file store.
pub fn append_store(path: &Path, entries: &[Revocation]) -> Result<(), RevocationError> {
    let err = |detail: String| RevocationError::Store {
        path: path.display().to_string(),
        detail,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| err(e.to_string()))?;
    let buf = render_store(entries).map_err(err)?;
    f.write_all(buf.as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(|e| err(e.to_string()))
}

/// The entries of `new` that change something over `existing`: a
/// revocation of a serial not in force there, an un-revocation of a serial
/// whose last entry there is not already one (a replica may hold a serial
/// the store lost). Each is timed after every entry of its serial in
/// `existing`, so the order of the log decides, not the writers' clocks.
pub fn plan(existing: &[Revocation], new: Vec<Revocation>) -> Vec<Revocation> {
    let mut ledger = Ledger::new();
    ledger.apply(
        StoreSource::File,
        SourceRead::Entries(existing.to_vec()),
        OffsetDateTime::now_utc(),
    );
    let in_force: std::collections::BTreeSet<String> =
        ledger.in_force().into_iter().map(|r| r.serial).collect();
    let last = |serial: &str| {
        existing
            .iter()
            .filter(|r| r.serial == serial)
            .max_by_key(|r| (r.revoked_at, !r.is_unrevoke()))
    };
    let mut seen = std::collections::BTreeSet::new();
    new.into_iter()
        .filter(|r| match r.is_unrevoke() {
            false => !in_force.contains(&r.serial),
            true => last(&r.serial).is_none_or(|l| !l.is_unrevoke()),
        })
        .filter(|r| seen.insert(r.serial.clone()))
        .map(|mut r| {
            if let Some(l) = last(&r.serial).filter(|l| l.revoked_at >= r.revoked_at) {
                r.revoked_at = l.revoked_at + time::Duration::milliseconds(1);
            }
            r
        })
        .collect()
}

/// `entries` without those of certificates expired more than
/// [`PRUNE_AFTER`] before `now`.
pub fn prune(entries: Vec<Revocation>, now: OffsetDateTime) -> Vec<Revocation> {
    entries
        .into_iter()
        .filter(|r| r.not_after.is_none_or(|t| t + PRUNE_AFTER > now))
        .collect()
}

fn kube_err(e: kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
        other => other.to_string(),
    }
}

/// One read of the ConfigMap store.
pub async fn read_configmap(client: &kube::Client, namespace: &str, name: &str) -> SourceRead {
    use k8s_openapi::api::core::v1::ConfigMap;
    let api: kube::Api<ConfigMap> = kube::Api::namespaced(client.clone(), namespace);
    match api.get_opt(name).await {
        Ok(None) => SourceRead::Missing,
        Ok(Some(cm)) => match parse_store(crate::denylist::configmap_text(&cm, CONFIGMAP_KEY)) {
            Ok(e) => SourceRead::Entries(e),
            Err(e) => SourceRead::Unreadable(e),
        },
        Err(e) => SourceRead::Unreadable(kube_err(e)),
    }
}

/// Appends `entries` to the ConfigMap store with compare-and-swap on its
/// resourceVersion (concurrent writers retry; none overwrites another),
/// creating it if needed. Returns the entries written (no-ops dropped,
/// see [`plan`]). A store that does not parse is left alone: fix it
/// first (the server keeps what it read last meanwhile).
pub async fn append_configmap(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    entries: Vec<Revocation>,
    now: OffsetDateTime,
) -> Result<Vec<Revocation>, RevocationError> {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::PostParams;
    let err = |detail: String| RevocationError::Store {
        path: format!("configmap {namespace}/{name}"),
        detail,
    };
    let api: kube::Api<ConfigMap> = kube::Api::namespaced(client.clone(), namespace);
    let pp = PostParams {
        field_manager: Some("meshca-revoke".into()),
        ..Default::default()
    };
    for _ in 0..16 {
        let current = api.get_opt(name).await.map_err(|e| err(kube_err(e)))?;
        let (existing, base) = match current {
            None => (Vec::new(), None),
            Some(cm) => {
                if cm.immutable == Some(true) {
                    return Err(err("the ConfigMap is immutable; delete it and revoke again (the server keeps what it read)".into()));
                }
                (
                    parse_store(crate::denylist::configmap_text(&cm, CONFIGMAP_KEY))
                        .map_err(|e| err(format!("does not parse ({e}); fix it first")))?,
                    Some(cm),
                )
            }
        };
        let add = plan(&existing, entries.clone());
        if add.is_empty() {
            return Ok(add);
        }
        let mut all = prune(existing, now);
        all.extend(add.iter().cloned());
        let text = render_store(&all).map_err(err)?;
        let result = match base {
            None => {
                let cm = ConfigMap {
                    metadata: kube::api::ObjectMeta {
                        name: Some(name.into()),
                        namespace: Some(namespace.into()),
                        ..Default::default()
                    },
                    data: Some([(CONFIGMAP_KEY.to_string(), text)].into()),
                    ..Default::default()
                };
                api.create(&pp, &cm).await
            }
            Some(mut cm) => {
                cm.metadata.managed_fields = None;
                cm.data
                    .get_or_insert_with(Default::default)
                    .insert(CONFIGMAP_KEY.into(), text);
                // Carries the resourceVersion read: a concurrent write fails with Conflict.
                api.replace(name, &pp, &cm).await
            }
        };
        match result {
            Ok(_) => return Ok(add),
            Err(kube::Error::Api(s)) if s.is_conflict() || s.is_already_exists() => continue,
            Err(e) => return Err(err(kube_err(e))),
        }
    }
    Err(err("gave up after 16 concurrent updates".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    fn rev(serial: &str, unrevoke: bool, not_after: Option<OffsetDateTime>) -> Revocation {
        Revocation {
            serial: serial.into(),
            reason: "key-compromise".into(),
            revoked_at: datetime!(2026-06-01 00:00 UTC),
            identity: None,
            node: None,
            not_after,
            by: None,
            action: unrevoke.then(|| super::super::UNREVOKE.into()),
        }
    }

    #[test]
    fn plan_drops_what_changes_nothing_and_orders_by_the_log() {
        let mut lifted = rev("ee", true, None);
        lifted.revoked_at += time::Duration::minutes(1);
        let existing = vec![rev("aa", false, None), rev("ee", false, None), lifted];
        let new = vec![
            rev("aa", false, None), // already revoked
            rev("bb", false, None),
            rev("bb", false, None), // twice in one call
            rev("ee", true, None),  // already lifted
            rev("cc", true, None),  // unknown to the store: a replica may hold it
            rev("aa", true, None),
        ];
        let got = plan(&existing, new);
        let kinds: Vec<(&str, bool)> = got
            .iter()
            .map(|r| (r.serial.as_str(), r.is_unrevoke()))
            .collect();
        assert_eq!(kinds, [("bb", false), ("cc", true), ("aa", true)]);
        // The undo of aa was written with a clock at (or behind) aa's
        // revocation: it is timed after it, so it lifts it.
        let aa = got.iter().find(|r| r.serial == "aa").unwrap();
        assert!(aa.revoked_at > existing[0].revoked_at);
        let mut l = Ledger::new();
        let mut all = existing.clone();
        all.extend(got);
        l.apply(
            StoreSource::File,
            SourceRead::Entries(all),
            datetime!(2026-06-01 12:00 UTC),
        );
        let in_force: Vec<String> = l.in_force().into_iter().map(|r| r.serial).collect();
        assert_eq!(in_force, ["bb"]);
    }

    #[test]
    fn prune_keeps_all_but_long_expired_certificates() {
        let now = datetime!(2026-06-01 12:00 UTC);
        let entries = vec![
            rev("live", false, Some(now + time::Duration::hours(1))),
            rev("just", false, Some(now - time::Duration::minutes(30))),
            rev("old", false, Some(now - time::Duration::hours(2))),
            rev("unknown", false, None),
        ];
        let kept: Vec<String> = prune(entries, now).into_iter().map(|r| r.serial).collect();
        assert_eq!(kept, ["live", "just", "unknown"]);
    }

    #[test]
    fn file_store_round_trips_and_a_torn_line_is_unreadable() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.jsonl");
        assert_eq!(read_file(&p), SourceRead::Missing);
        let a = rev("aa", false, None);
        append_store(&p, std::slice::from_ref(&a)).unwrap();
        append_store(&p, &[rev("aa", true, None)]).unwrap();
        let SourceRead::Entries(e) = read_file(&p) else {
            panic!("entries")
        };
        assert_eq!(e.len(), 2);
        assert!(!e[0].is_unrevoke() && e[1].is_unrevoke());
        std::fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .unwrap()
            .write_all(b"{\"serial\":")
            .unwrap();
        assert!(matches!(read_file(&p), SourceRead::Unreadable(_)));
        assert_eq!(
            read_store(&p).unwrap_err().reason(),
            "revocation_store_failed"
        );
    }
}
