//! RFC 7512 `pkcs11:` URIs naming the CA key: which module, which token,
//! which object, and where the PIN comes from. Parsed once at startup.

use std::path::PathBuf;

use super::SignerError;

/// Environment variable holding the token PIN when the URI has no `pin-source`.
pub const PIN_ENV: &str = "MESHCA_PKCS11_PIN";

/// A parsed `pkcs11:` URI.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Pkcs11Uri {
    pub module_path: PathBuf,
    /// Token label (`token=`).
    pub token: Option<String>,
    /// Token serial number (`serial=`).
    pub serial: Option<String>,
    /// Key label (`object=`).
    pub object: Option<String>,
    /// Key id (`id=`, raw bytes).
    pub id: Option<Vec<u8>>,
    /// File holding the PIN (`pin-source=file:/path`).
    pub pin_source: Option<PathBuf>,
}

impl std::fmt::Display for Pkcs11Uri {
    /// The URI without secrets (there are none in it: the PIN is never in a URI).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut path = Vec::new();
        if let Some(t) = &self.token {
            path.push(format!("token={}", encode(t.as_bytes())));
        }
        if let Some(s) = &self.serial {
            path.push(format!("serial={}", encode(s.as_bytes())));
        }
        if let Some(o) = &self.object {
            path.push(format!("object={}", encode(o.as_bytes())));
        }
        if let Some(id) = &self.id {
            let hex: String = id.iter().map(|b| format!("%{b:02x}")).collect();
            path.push(format!("id={hex}"));
        }
        write!(f, "pkcs11:{}", path.join(";"))?;
        write!(
            f,
            "?module-path={}",
            encode(self.module_path.to_string_lossy().as_bytes())
        )?;
        if let Some(p) = &self.pin_source {
            write!(
                f,
                "&pin-source=file:{}",
                encode(p.to_string_lossy().as_bytes())
            )?;
        }
        Ok(())
    }
}

fn encode(v: &[u8]) -> String {
    v.iter()
        .map(|&b| {
            if b.is_ascii_alphanumeric() || b"-._~/:".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn decode(v: &str) -> Result<Vec<u8>, SignerError> {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| SignerError::Uri(format!("bad percent-encoding in {v:?}")))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Ok(out)
}

fn text(attr: &str, v: &str) -> Result<String, SignerError> {
    String::from_utf8(decode(v)?).map_err(|_| SignerError::Uri(format!("{attr} is not UTF-8")))
}

impl std::str::FromStr for Pkcs11Uri {
    type Err = SignerError;

    fn from_str(s: &str) -> Result<Self, SignerError> {
        let rest = s
            .strip_prefix("pkcs11:")
            .ok_or_else(|| SignerError::Uri("must start with pkcs11:".into()))?;
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut uri = Pkcs11Uri::default();
        let mut module = None;
        for attr in path.split(';').filter(|a| !a.is_empty()) {
            let (k, v) = attr
                .split_once('=')
                .ok_or_else(|| SignerError::Uri(format!("path attribute {attr:?} has no value")))?;
            match k {
                "token" => uri.token = Some(text(k, v)?),
                "serial" => uri.serial = Some(text(k, v)?),
                "object" => uri.object = Some(text(k, v)?),
                "id" => uri.id = Some(decode(v)?),
                "type" if v == "private" => {}
                "type" => {
                    return Err(SignerError::Uri(format!(
                        "type={v}: the CA key is a private key (type=private)"
                    )))
                }
                // Refused rather than ignored: a misspelt attribute would
                // otherwise widen the match to some other key.
                other => {
                    return Err(SignerError::Uri(format!(
                        "unsupported path attribute {other:?} (use token, serial, object, id)"
                    )))
                }
            }
        }
        for attr in query.split('&').filter(|a| !a.is_empty()) {
            let (k, v) = attr.split_once('=').ok_or_else(|| {
                SignerError::Uri(format!("query attribute {attr:?} has no value"))
            })?;
            match k {
                "module-path" => module = Some(PathBuf::from(text(k, v)?)),
                "pin-source" => {
                    let v = text(k, v)?;
                    let path = v.strip_prefix("file:").unwrap_or(&v);
                    let path = path.strip_prefix("//").unwrap_or(path);
                    if !path.starts_with('/') {
                        return Err(SignerError::Uri(format!(
                            "pin-source {v:?} must be an absolute file path (file:/path)"
                        )));
                    }
                    uri.pin_source = Some(PathBuf::from(path));
                }
                "pin-value" => {
                    return Err(SignerError::Uri(format!(
                        "pin-value is refused: a PIN in a URI ends up in process lists and logs; use pin-source=file:/path or {PIN_ENV}"
                    )))
                }
                other => {
                    return Err(SignerError::Uri(format!(
                        "unsupported query attribute {other:?} (use module-path, pin-source)"
                    )))
                }
            }
        }
        uri.module_path = module.ok_or_else(|| {
            SignerError::Uri(
                "module-path is required (e.g. ?module-path=/usr/lib/softhsm/libsofthsm2.so)"
                    .into(),
            )
        })?;
        if uri.object.is_none() && uri.id.is_none() {
            return Err(SignerError::Uri(
                "name the key with object=<label> or id=<hex bytes>".into(),
            ));
        }
        Ok(uri)
    }
}

/// `uri` fit for an error message: a `pin-value` is replaced, so a PIN
/// passed where it must not be is not echoed into logs.
pub fn redact(uri: &str) -> String {
    let Some((path, query)) = uri.split_once('?') else {
        return uri.to_string();
    };
    let query: Vec<String> = query
        .split('&')
        .map(|a| match a.split_once('=') {
            Some(("pin-value", _)) => "pin-value=<redacted>".to_string(),
            _ => a.to_string(),
        })
        .collect();
    format!("{path}?{}", query.join("&"))
}

/// Which key in the token signs one CA generation: the `object=`/`id=` of a
/// URI. A generation directory names its key with a `ca-key.uri` file
/// holding only these (`pkcs11:object=ica-2`); the module, token and PIN
/// always come from `MESHCA_SIGNER`, so one login serves every generation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct KeyName {
    pub object: Option<String>,
    pub id: Option<Vec<u8>>,
}

impl std::fmt::Display for KeyName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut path = Vec::new();
        if let Some(o) = &self.object {
            path.push(format!("object={}", encode(o.as_bytes())));
        }
        if let Some(id) = &self.id {
            let hex: String = id.iter().map(|b| format!("%{b:02x}")).collect();
            path.push(format!("id={hex}"));
        }
        write!(f, "pkcs11:{}", path.join(";"))
    }
}

impl std::str::FromStr for KeyName {
    type Err = SignerError;

    /// Parses a `ca-key.uri` text: one `pkcs11:` URI naming a private key by
    /// `object=` and/or `id=`. Anything else is refused rather than ignored,
    /// so a key file cannot quietly point at another token or module.
    fn from_str(s: &str) -> Result<Self, SignerError> {
        let s = s.trim();
        let rest = s
            .strip_prefix("pkcs11:")
            .ok_or_else(|| SignerError::Uri("ca-key.uri must hold a pkcs11: URI".into()))?;
        if rest.contains('?') {
            return Err(SignerError::Uri(
                "ca-key.uri names the key only (object=, id=); module-path and pin-source come from MESHCA_SIGNER".into(),
            ));
        }
        let mut name = KeyName::default();
        for attr in rest.split(';').filter(|a| !a.is_empty()) {
            let (k, v) = attr
                .split_once('=')
                .ok_or_else(|| SignerError::Uri(format!("path attribute {attr:?} has no value")))?;
            match k {
                "object" => name.object = Some(text(k, v)?),
                "id" => name.id = Some(decode(v)?),
                "type" if v == "private" => {}
                other => {
                    return Err(SignerError::Uri(format!(
                        "ca-key.uri attribute {other:?} is not allowed: it names the key with object= or id= only (the token comes from MESHCA_SIGNER)"
                    )))
                }
            }
        }
        if name.object.is_none() && name.id.is_none() {
            return Err(SignerError::Uri(
                "ca-key.uri names no key: give object=<label> or id=<hex bytes>".into(),
            ));
        }
        Ok(name)
    }
}

impl Pkcs11Uri {
    /// The key this URI names.
    pub fn key_name(&self) -> KeyName {
        KeyName {
            object: self.object.clone(),
            id: self.id.clone(),
        }
    }

    /// The same module, token and PIN, naming another key.
    pub fn with_key(&self, key: &KeyName) -> Self {
        Self {
            object: key.object.clone(),
            id: key.id.clone(),
            ..self.clone()
        }
    }

    /// The PIN: the pin-source file's first line, else [`PIN_ENV`].
    pub fn read_pin(&self) -> Result<zeroize::Zeroizing<String>, SignerError> {
        let pin = match &self.pin_source {
            Some(p) => {
                let raw = zeroize::Zeroizing::new(std::fs::read_to_string(p).map_err(|e| {
                    SignerError::Pin(format!("reading pin-source {}: {e}", p.display()))
                })?);
                zeroize::Zeroizing::new(raw.lines().next().unwrap_or_default().to_string())
            }
            None => zeroize::Zeroizing::new(std::env::var(PIN_ENV).map_err(|_| {
                SignerError::Pin(format!("no pin-source in the URI and {PIN_ENV} is not set"))
            })?),
        };
        if pin.is_empty() {
            return Err(SignerError::Pin("the PIN is empty".into()));
        }
        Ok(pin)
    }

    /// How the key is named, for errors.
    pub fn key_description(&self) -> String {
        match (&self.object, &self.id) {
            (Some(o), Some(id)) => format!("label {o:?} and id {}", hex::encode(id)),
            (Some(o), None) => format!("label {o:?}"),
            (None, Some(id)) => format!("id {}", hex::encode(id)),
            (None, None) => "no label or id".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test]
    fn full_uri_parses_and_prints_back() {
        let s = "pkcs11:token=mesh%20ca;object=ica;id=%01%02;type=private?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/run/pin";
        let u: Pkcs11Uri = s.parse().unwrap();
        assert_eq!(u.token.as_deref(), Some("mesh ca"));
        assert_eq!(u.object.as_deref(), Some("ica"));
        assert_eq!(u.id.as_deref(), Some(&[1u8, 2][..]));
        assert_eq!(
            u.module_path,
            PathBuf::from("/usr/lib/softhsm/libsofthsm2.so")
        );
        assert_eq!(u.pin_source, Some(PathBuf::from("/run/pin")));
        let again: Pkcs11Uri = u.to_string().parse().unwrap();
        assert_eq!(again, u);
    }

    #[test_case("pkcs11:object=k", "module-path is required" ; "no module")]
    #[test_case("pkcs11:token=t?module-path=/m.so", "object=" ; "no key name")]
    #[test_case("pkcs11:object=k?module-path=/m.so&pin-value=1234", "pin-value is refused" ; "pin in uri")]
    #[test_case("pkcs11:objekt=k?module-path=/m.so", "unsupported path attribute" ; "typo")]
    #[test_case("pkcs11:object=k;type=cert?module-path=/m.so", "type=private" ; "wrong type")]
    #[test_case("pkcs11:object=k?module-path=/m.so&pin-source=pin.txt", "absolute" ; "relative pin")]
    #[test_case("pkcs11:id=%zz?module-path=/m.so", "percent" ; "bad escape")]
    #[test_case("file:/x", "pkcs11:" ; "scheme")]
    fn bad_uris_say_what_is_wrong(s: &str, needle: &str) {
        let err = s.parse::<Pkcs11Uri>().unwrap_err();
        assert_eq!(err.reason(), "signer_uri");
        assert!(err.to_string().contains(needle), "{err}");
    }

    #[test_case(
        "pkcs11:object=k?module-path=/m.so&pin-value=1234",
        "pkcs11:object=k?module-path=/m.so&pin-value=<redacted>"
    )]
    #[test_case(
        "pkcs11:object=k?pin-value=1234&module-path=/m.so",
        "pkcs11:object=k?pin-value=<redacted>&module-path=/m.so"
    )]
    #[test_case("pkcs11:object=k", "pkcs11:object=k")]
    fn redact_hides_pin_values(uri: &str, want: &str) {
        assert_eq!(redact(uri), want);
    }

    #[test]
    fn pin_comes_from_the_file_first_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pin");
        std::fs::write(&p, "1234\n").unwrap();
        let u = Pkcs11Uri {
            pin_source: Some(p),
            ..Default::default()
        };
        assert_eq!(u.read_pin().unwrap().as_str(), "1234");
        std::fs::write(u.pin_source.as_ref().unwrap(), "\n").unwrap();
        assert_eq!(u.read_pin().unwrap_err().reason(), "signer_pin_source");
    }

    #[test_case("pkcs11:object=ica-2", Some("ica-2"), None ; "label")]
    #[test_case(" pkcs11:id=%02%ff;type=private\n", None, Some(&[2u8, 255][..]) ; "id, type and whitespace")]
    #[test_case("pkcs11:object=a%20b;id=%01", Some("a b"), Some(&[1u8][..]) ; "both")]
    fn key_names_parse_and_print_back(s: &str, object: Option<&str>, id: Option<&[u8]>) {
        let k: KeyName = s.parse().unwrap();
        assert_eq!(k.object.as_deref(), object);
        assert_eq!(k.id.as_deref(), id);
        assert_eq!(k.to_string().parse::<KeyName>().unwrap(), k);
    }

    #[test_case("object=k", "pkcs11: URI" ; "no scheme")]
    #[test_case("pkcs11:token=t;object=k", "not allowed" ; "token")]
    #[test_case("pkcs11:object=k?module-path=/m.so", "names the key only" ; "query")]
    #[test_case("pkcs11:", "names no key" ; "empty")]
    #[test_case("pkcs11:type=private", "names no key" ; "type only")]
    #[test_case("pkcs11:id=%z1", "percent" ; "bad escape")]
    fn bad_key_names_say_what_is_wrong(s: &str, needle: &str) {
        let err = s.parse::<KeyName>().unwrap_err();
        assert_eq!(err.reason(), "signer_uri");
        assert!(err.to_string().contains(needle), "{err}");
    }

    #[test]
    fn with_key_keeps_module_token_and_pin() {
        let u: Pkcs11Uri = "pkcs11:token=t;object=a?module-path=/m.so&pin-source=/p"
            .parse()
            .unwrap();
        let k: KeyName = "pkcs11:object=b".parse().unwrap();
        let v = u.with_key(&k);
        assert_eq!(v.key_name(), k);
        assert_eq!(
            (v.token, v.module_path, v.pin_source),
            (u.token, u.module_path, u.pin_source)
        );
    }
}
