//! Small primitives every domain may use: SHA-256, PEM text, a lock that
//! survives poisoning and API discovery. This module imports nothing from
//! the crate, so any module can depend on it without tying the import graph
//! into a circle.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// SHA-256 of `data`.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    let d = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, data);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// The hex digits of a serial as people write it (`0x` prefix, colons,
/// upper case), lower-cased; `None` unless only hex digits remain.
pub fn serial_hex_digits(s: &str) -> Option<String> {
    let t: String = s
        .trim()
        .trim_start_matches("0x")
        .chars()
        .filter(|c| *c != ':')
        .collect::<String>()
        .to_ascii_lowercase();
    (!t.is_empty() && t.chars().all(|c| c.is_ascii_hexdigit())).then_some(t)
}

/// PEM-encodes one DER object with 64-column lines and `\n` endings.
pub fn pem_encode(label: &str, der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// Locks `m`, taking the data even when a thread panicked while holding it:
/// one panic must not make every later caller panic too.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The first of `versions` (newest first) in which the API server serves
/// `plural` of `group`, as the resource of `kind`; `None` when it serves
/// none of them (a 404 for a version means not served).
pub async fn served_resource(
    client: &kube::Client,
    group: &str,
    versions: &[&str],
    kind: &str,
    plural: &str,
) -> Result<Option<kube::api::ApiResource>, kube::Error> {
    for v in versions {
        match client
            .list_api_group_resources(&format!("{group}/{v}"))
            .await
        {
            Ok(list) if list.resources.iter().any(|r| r.name == plural) => {
                let gvk = kube::api::GroupVersionKind::gvk(group, v, kind);
                return Ok(Some(kube::api::ApiResource::from_gvk_with_plural(
                    &gvk, plural,
                )));
            }
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_the_empty_string() {
        assert_eq!(
            hex::encode(sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn pem_lines_are_64_columns() {
        let pem = pem_encode("X", &[0u8; 100]);
        let lines: Vec<&str> = pem.lines().collect();
        assert_eq!(lines[0], "-----BEGIN X-----");
        assert_eq!(lines[1].len(), 64);
        assert_eq!(*lines.last().unwrap(), "-----END X-----");
    }

    #[test]
    fn a_poisoned_lock_still_yields_its_data() {
        let m = std::sync::Arc::new(Mutex::new(7));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        assert_eq!(*lock(&m), 7);
    }
}
