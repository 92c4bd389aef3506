//! The CA key in a PKCS#11 token (an HSM; SoftHSM2 in tests). The key never
//! leaves the token: meshca sends it digests and gets signatures back.
//!
//! Sessions are pooled (one signature at a time per session, as PKCS#11
//! requires). A session or module failure is recovered by opening new
//! sessions, or by initializing the module again and finding the key anew;
//! the failed signature is retried once on the new connection.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use cryptoki::context::{CInitializeArgs, CInitializeFlags, Pkcs11};
use cryptoki::error::{Error as CkError, RvError};
use cryptoki::mechanism::Mechanism;
use cryptoki::object::{Attribute, AttributeType, KeyType, ObjectClass, ObjectHandle};
use cryptoki::session::{Session, UserType};
use cryptoki::slot::Slot;
use cryptoki::types::AuthPin;

use super::uri::Pkcs11Uri;
use super::{ecdsa_raw_to_der, KeyAlgorithm, Signer, SignerError};

/// How long a signature waits for a free session before failing.
const SESSION_WAIT: Duration = Duration::from_secs(5);
/// A broken module is not re-initialized more often than this.
const RECONNECT_INTERVAL: Duration = Duration::from_secs(1);

const OID_P256: &[u8] = &[0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
const OID_P384: &[u8] = &[0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x22];

/// What a failed PKCS#11 call calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// The call failed on its merits: no reconnect.
    None,
    /// This session is gone: open another.
    Session,
    /// The module, token or key handle is gone: initialize again, find the key again.
    Module,
}

/// Decides how to recover from a PKCS#11 return value.
pub fn recovery(rv: RvError) -> Recovery {
    use RvError::*;
    match rv {
        SessionHandleInvalid | SessionClosed | UserNotLoggedIn => Recovery::Session,
        CryptokiNotInitialized
        | DeviceRemoved
        | DeviceError
        | TokenNotPresent
        | TokenNotRecognized
        | KeyHandleInvalid
        | ObjectHandleInvalid
        | GeneralError
        | SlotIdInvalid => Recovery::Module,
        _ => Recovery::None,
    }
}

fn rv_of(e: &CkError) -> Option<RvError> {
    match e {
        CkError::Pkcs11(rv, _) => Some(*rv),
        _ => None,
    }
}

fn short(e: &CkError) -> String {
    match e {
        // cryptoki's Display for a return value is a paragraph; the code and
        // the function say enough.
        CkError::Pkcs11(rv, f) => format!("{rv:?} from {f:?}"),
        other => other.to_string(),
    }
}

/// One connection to the module: the slot and the key handle found in it.
struct Conn {
    ctx: Pkcs11,
    slot: Slot,
    key: ObjectHandle,
    generation: u64,
}

struct Pool {
    idle: Vec<(Session, u64)>,
    open: usize,
}

/// A signer whose key is a private key object in a PKCS#11 token.
pub struct Pkcs11Signer {
    uri: Pkcs11Uri,
    token_name: String,
    pin: AuthPin,
    algorithm: KeyAlgorithm,
    public: Vec<u8>,
    max_sessions: usize,
    conn: Mutex<(Option<Conn>, Option<Instant>)>,
    pool: Mutex<Pool>,
    freed: Condvar,
    generation: AtomicU64,
    reconnects: AtomicU64,
}

impl std::fmt::Debug for Pkcs11Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pkcs11Signer")
            .field("uri", &self.uri.to_string())
            .field("algorithm", &self.algorithm)
            .finish_non_exhaustive()
    }
}

/// Loads and initializes the module (an already initialized module is fine).
pub fn load_module(uri: &Pkcs11Uri) -> Result<Pkcs11, SignerError> {
    let module_err = |detail: String| SignerError::Module {
        path: uri.module_path.display().to_string(),
        detail,
    };
    let ctx = Pkcs11::new(&uri.module_path)
        .map_err(|e| module_err(format!("cannot load it as a PKCS#11 library: {e}")))?;
    initialize(&ctx).map_err(|e| module_err(format!("C_Initialize failed: {}", short(&e))))?;
    Ok(ctx)
}

fn initialize(ctx: &Pkcs11) -> Result<(), CkError> {
    match ctx.initialize(CInitializeArgs::new(CInitializeFlags::OS_LOCKING_OK)) {
        Err(CkError::Pkcs11(RvError::CryptokiAlreadyInitialized, _)) => Ok(()),
        r => r,
    }
}

/// Finds the token the URI names (by label or serial; the only token when it names none).
pub fn find_slot(ctx: &Pkcs11, uri: &Pkcs11Uri) -> Result<(Slot, String), SignerError> {
    let dev = |e: CkError| SignerError::Device(short(&e));
    let mut present = Vec::new();
    let mut found = Vec::new();
    for slot in ctx.get_slots_with_initialized_token().map_err(dev)? {
        let info = ctx.get_token_info(slot).map_err(dev)?;
        let label = info.label().trim_end().to_string();
        let serial = info.serial_number().trim_end().to_string();
        let matches = uri.token.as_deref().is_none_or(|t| t == label)
            && uri.serial.as_deref().is_none_or(|s| s == serial);
        if matches {
            found.push((slot, label.clone()));
        }
        present.push(format!("{label:?} (serial {serial})"));
    }
    let wanted = match (&uri.token, &uri.serial) {
        (Some(t), _) => format!("{t:?}"),
        (None, Some(s)) => format!("with serial {s}"),
        (None, None) => "(the only token)".into(),
    };
    match found.len() {
        1 => Ok(found.remove(0)),
        _ if found.is_empty() => Err(SignerError::TokenNotFound { wanted, present }),
        _ => Err(SignerError::TokenNotFound {
            wanted: format!("{wanted}: several match; name one with token= or serial="),
            present,
        }),
    }
}

/// Logs the user in (once per application and token; later sessions share it).
pub fn login(session: &Session, pin: &AuthPin, token: &str) -> Result<(), SignerError> {
    match session.login(UserType::User, Some(pin)) {
        Ok(()) | Err(CkError::Pkcs11(RvError::UserAlreadyLoggedIn, _)) => Ok(()),
        Err(CkError::Pkcs11(RvError::PinIncorrect, _)) => {
            Err(SignerError::PinIncorrect(token.to_string()))
        }
        Err(CkError::Pkcs11(RvError::PinLocked, _)) => {
            Err(SignerError::PinLocked(token.to_string()))
        }
        Err(e) => Err(SignerError::Device(format!("login: {}", short(&e)))),
    }
}

fn key_template(uri: &Pkcs11Uri, class: ObjectClass) -> Vec<Attribute> {
    let mut t = vec![Attribute::Class(class)];
    if let Some(o) = &uri.object {
        t.push(Attribute::Label(o.as_bytes().to_vec()));
    }
    if let Some(id) = &uri.id {
        t.push(Attribute::Id(id.clone()));
    }
    t
}

fn find_one(
    session: &Session,
    uri: &Pkcs11Uri,
    token: &str,
    class: ObjectClass,
) -> Result<Option<ObjectHandle>, SignerError> {
    let found = session
        .find_objects(&key_template(uri, class))
        .map_err(|e| SignerError::Device(format!("finding the key: {}", short(&e))))?;
    match found.len() {
        0 => Ok(None),
        1 => Ok(Some(found[0])),
        count => Err(SignerError::KeyAmbiguous {
            token: token.to_string(),
            what: uri.key_description(),
            count,
        }),
    }
}

/// The private key, its algorithm and public key bits.
fn find_key(
    session: &Session,
    uri: &Pkcs11Uri,
    token: &str,
) -> Result<(ObjectHandle, KeyAlgorithm, Vec<u8>), SignerError> {
    let key = find_one(session, uri, token, ObjectClass::PRIVATE_KEY)?.ok_or_else(|| {
        SignerError::KeyNotFound {
            token: token.to_string(),
            what: uri.key_description(),
        }
    })?;
    let public = find_one(session, uri, token, ObjectClass::PUBLIC_KEY)?.ok_or_else(|| {
        SignerError::PublicKeyNotFound {
            token: token.to_string(),
            what: uri.key_description(),
        }
    })?;
    let dev = |e: CkError| SignerError::Device(format!("reading key attributes: {}", short(&e)));
    let attrs = session
        .get_attributes(
            public,
            &[
                AttributeType::KeyType,
                AttributeType::EcParams,
                AttributeType::EcPoint,
                AttributeType::Modulus,
                AttributeType::PublicExponent,
            ],
        )
        .map_err(dev)?;
    let (mut kt, mut params, mut point, mut n, mut e) = (None, None, None, None, None);
    for a in attrs {
        match a {
            Attribute::KeyType(t) => kt = Some(t),
            Attribute::EcParams(p) => params = Some(p),
            Attribute::EcPoint(p) => point = Some(p),
            Attribute::Modulus(m) => n = Some(m),
            Attribute::PublicExponent(x) => e = Some(x),
            _ => {}
        }
    }
    let (algorithm, bits) = match kt {
        Some(KeyType::EC) => {
            let params = params.unwrap_or_default();
            let alg = match params.as_slice() {
                OID_P256 => KeyAlgorithm::EcdsaP256,
                OID_P384 => KeyAlgorithm::EcdsaP384,
                other => {
                    return Err(SignerError::Unsupported(format!(
                        "EC key on curve {} (use P-256 or P-384)",
                        hex::encode(other)
                    )))
                }
            };
            let point = ec_point(&point.unwrap_or_default(), alg)?;
            (alg, point)
        }
        Some(KeyType::RSA) => {
            let (n, e) = (n.unwrap_or_default(), e.unwrap_or_default());
            if n.len() * 8 < 2048 {
                return Err(SignerError::Unsupported(format!(
                    "RSA key of {} bits is below 2048",
                    n.len() * 8
                )));
            }
            (KeyAlgorithm::Rsa, rsa_public_key(&n, &e))
        }
        other => {
            return Err(SignerError::Unsupported(format!(
                "key type {other:?} (use EC P-256/P-384 or RSA)"
            )))
        }
    };
    Ok((key, algorithm, bits))
}

/// CKA_EC_POINT is a DER OCTET STRING around the point (some tokens return
/// the bare point).
fn ec_point(v: &[u8], alg: KeyAlgorithm) -> Result<Vec<u8>, SignerError> {
    let n = 2 * alg.ec_field_len().unwrap_or(32) + 1;
    match v {
        [0x04, ..] if v.len() == n => Ok(v.to_vec()),
        [0x04, len, rest @ ..] if *len as usize == n && rest.len() == n => Ok(rest.to_vec()),
        _ => Err(SignerError::Unsupported(format!(
            "EC point of {} bytes is not an uncompressed {} point",
            v.len(),
            alg.as_str()
        ))),
    }
}

fn der_len(len: usize, out: &mut Vec<u8>) {
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes: Vec<u8> = len
            .to_be_bytes()
            .into_iter()
            .skip_while(|b| *b == 0)
            .collect();
        out.push(0x80 | bytes.len() as u8);
        out.extend(bytes);
    }
}

fn der_uint(v: &[u8], out: &mut Vec<u8>) {
    let v = &v[v
        .iter()
        .position(|b| *b != 0)
        .unwrap_or(v.len().saturating_sub(1))..];
    let pad = v.first().is_some_and(|b| b & 0x80 != 0);
    out.push(0x02);
    der_len(v.len() + usize::from(pad), out);
    if pad {
        out.push(0);
    }
    out.extend_from_slice(v);
}

/// PKCS#1 RSAPublicKey DER from the modulus and exponent.
pub fn rsa_public_key(n: &[u8], e: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    der_uint(n, &mut body);
    der_uint(e, &mut body);
    let mut out = vec![0x30];
    der_len(body.len(), &mut out);
    out.extend(body);
    out
}

impl Pkcs11Signer {
    /// Connects to the token the URI names, logs in and finds the key. Every
    /// failure says which of module, token, PIN or key is wrong.
    pub fn open(uri: &Pkcs11Uri, max_sessions: usize) -> Result<Self, SignerError> {
        let pin_text = uri.read_pin()?;
        let pin = AuthPin::from(pin_text.as_str().to_string());
        let ctx = load_module(uri)?;
        let (slot, token_name) = find_slot(&ctx, uri)?;
        let session = ctx
            .open_ro_session(slot)
            .map_err(|e| SignerError::Device(format!("opening a session: {}", short(&e))))?;
        login(&session, &pin, &token_name)?;
        let (key, algorithm, public) = find_key(&session, uri, &token_name)?;
        let signer = Self {
            uri: uri.clone(),
            token_name,
            pin,
            algorithm,
            public,
            max_sessions: max_sessions.max(1),
            conn: Mutex::new((
                Some(Conn {
                    ctx,
                    slot,
                    key,
                    generation: 0,
                }),
                None,
            )),
            pool: Mutex::new(Pool {
                idle: vec![(session, 0)],
                open: 1,
            }),
            freed: Condvar::new(),
            generation: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
        };
        // A key that cannot sign (wrong usage, wrong mechanism) fails here,
        // at startup, not on the first request.
        signer.sign(b"meshca startup probe")?;
        Ok(signer)
    }

    /// How many times the module connection was rebuilt after a failure.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    pub fn uri(&self) -> &Pkcs11Uri {
        &self.uri
    }

    /// The module context (tests use it to break the module under a running signer).
    pub fn context(&self) -> Option<Pkcs11> {
        self.conn
            .lock()
            .ok()
            .and_then(|c| c.0.as_ref().map(|c| c.ctx.clone()))
    }

    /// The current connection's key and generation, reconnecting if there is none.
    fn current(&self) -> Result<(ObjectHandle, u64, Pkcs11, Slot), SignerError> {
        let guard = self
            .conn
            .lock()
            .map_err(|_| SignerError::Unavailable("connection lock poisoned".into()))?;
        match &guard.0 {
            Some(c) => Ok((c.key, c.generation, c.ctx.clone(), c.slot)),
            None => {
                drop(guard);
                self.reconnect(None)
            }
        }
    }

    /// Rebuilds the connection (unless someone already did since `seen`).
    fn reconnect(
        &self,
        seen: Option<u64>,
    ) -> Result<(ObjectHandle, u64, Pkcs11, Slot), SignerError> {
        let mut guard = self
            .conn
            .lock()
            .map_err(|_| SignerError::Unavailable("connection lock poisoned".into()))?;
        if let (Some(c), Some(seen)) = (&guard.0, seen) {
            if c.generation != seen {
                return Ok((c.key, c.generation, c.ctx.clone(), c.slot));
            }
        }
        if let Some(last) = guard.1 {
            if last.elapsed() < RECONNECT_INTERVAL && guard.0.is_none() {
                return Err(SignerError::Unavailable(format!(
                    "PKCS#11 token {} is down; next reconnect attempt within {RECONNECT_INTERVAL:?}",
                    self.token_name
                )));
            }
        }
        guard.1 = Some(Instant::now());
        let old = guard.0.take();
        // Sessions of the old connection are useless now.
        if let Ok(mut pool) = self.pool.lock() {
            pool.open -= pool.idle.len();
            pool.idle.clear();
        }
        let ctx = match old {
            Some(c) => c.ctx,
            None => load_module(&self.uri)?,
        };
        let attempt = (|| {
            initialize(&ctx)
                .map_err(|e| SignerError::Unavailable(format!("C_Initialize: {}", short(&e))))?;
            let (slot, token) = find_slot(&ctx, &self.uri)?;
            let session = ctx.open_ro_session(slot).map_err(|e| {
                SignerError::Unavailable(format!("opening a session: {}", short(&e)))
            })?;
            login(&session, &self.pin, &token)?;
            let (key, alg, public) = find_key(&session, &self.uri, &token)?;
            if alg != self.algorithm || public != self.public {
                return Err(SignerError::Unavailable(format!(
                    "the key found on reconnect ({}) is not the one meshca started with",
                    self.uri.key_description()
                )));
            }
            Ok((slot, key, session))
        })();
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        self.reconnects.fetch_add(1, Ordering::Relaxed);
        match attempt {
            Ok((slot, key, session)) => {
                tracing::warn!(token = %self.token_name, generation, "PKCS#11 connection rebuilt");
                if let Ok(mut pool) = self.pool.lock() {
                    pool.idle.push((session, generation));
                    pool.open += 1;
                }
                self.freed.notify_all();
                guard.0 = Some(Conn {
                    ctx: ctx.clone(),
                    slot,
                    key,
                    generation,
                });
                Ok((key, generation, ctx, slot))
            }
            Err(e) => {
                tracing::error!(token = %self.token_name, reason = e.reason(), error = %e, "PKCS#11 reconnect failed");
                // Keep the loaded library for the next attempt.
                guard.0 = None;
                drop(guard);
                Err(match e {
                    SignerError::Unavailable(_) => e,
                    other => SignerError::Unavailable(other.to_string()),
                })
            }
        }
    }

    /// A session of `generation`: an idle one, a new one, or one freed within the wait.
    fn checkout(&self, ctx: &Pkcs11, slot: Slot, generation: u64) -> Result<Session, SignerError> {
        let deadline = Instant::now() + SESSION_WAIT;
        let mut pool = self
            .pool
            .lock()
            .map_err(|_| SignerError::Unavailable("session pool lock poisoned".into()))?;
        loop {
            // Sessions from an older connection are closed, not reused.
            while let Some(i) = pool.idle.iter().position(|(_, g)| *g != generation) {
                pool.idle.swap_remove(i);
                pool.open -= 1;
            }
            if let Some((s, _)) = pool.idle.pop() {
                return Ok(s);
            }
            if pool.open < self.max_sessions {
                pool.open += 1;
                drop(pool);
                let opened = ctx
                    .open_ro_session(slot)
                    .map_err(|e| {
                        (
                            rv_of(&e),
                            SignerError::Device(format!("opening a session: {}", short(&e))),
                        )
                    })
                    .and_then(|s| {
                        login(&s, &self.pin, &self.token_name)
                            .map(|_| s)
                            .map_err(|e| (None, e))
                    });
                return match opened {
                    Ok(s) => Ok(s),
                    Err((_, e)) => {
                        if let Ok(mut p) = self.pool.lock() {
                            p.open -= 1;
                        }
                        self.freed.notify_one();
                        Err(e)
                    }
                };
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(SignerError::Busy(SESSION_WAIT));
            }
            pool = self
                .freed
                .wait_timeout(pool, deadline - now)
                .map_err(|_| SignerError::Unavailable("session pool lock poisoned".into()))?
                .0;
        }
    }

    fn checkin(&self, session: Session, generation: u64) {
        if let Ok(mut pool) = self.pool.lock() {
            pool.idle.push((session, generation));
        }
        self.freed.notify_one();
    }

    fn drop_idle(&self) {
        if let Ok(mut pool) = self.pool.lock() {
            let n = pool.idle.len();
            pool.idle.clear();
            pool.open -= n;
        }
        self.freed.notify_all();
    }

    fn discard(&self, session: Session) {
        drop(session);
        if let Ok(mut pool) = self.pool.lock() {
            pool.open = pool.open.saturating_sub(1);
        }
        self.freed.notify_one();
    }

    fn sign_once(
        &self,
        data: &[u8],
        mech: &Mechanism<'_>,
    ) -> Result<Vec<u8>, (Recovery, u64, SignerError)> {
        let (key, generation, ctx, slot) = self.current().map_err(|e| (Recovery::None, 0, e))?;
        let session = match self.checkout(&ctx, slot, generation) {
            Ok(s) => s,
            Err(e @ SignerError::Busy(_)) => return Err((Recovery::None, generation, e)),
            // The module failed while opening a session.
            Err(e) => return Err((Recovery::Module, generation, e)),
        };
        match session.sign(mech, key, data) {
            Ok(sig) => {
                self.checkin(session, generation);
                Ok(sig)
            }
            Err(e) => {
                let rec = rv_of(&e).map_or(Recovery::None, recovery);
                let err = SignerError::Device(format!(
                    "C_Sign on token {}: {}",
                    self.token_name,
                    short(&e)
                ));
                match rec {
                    Recovery::None => self.checkin(session, generation),
                    _ => self.discard(session),
                }
                Err((rec, generation, err))
            }
        }
    }
}

impl Signer for Pkcs11Signer {
    fn algorithm(&self) -> KeyAlgorithm {
        self.algorithm
    }
    fn public_key(&self) -> &[u8] {
        &self.public
    }
    fn sign(&self, tbs: &[u8]) -> Result<Vec<u8>, SignerError> {
        use aws_lc_rs::digest;
        let (data, mech) = match self.algorithm {
            KeyAlgorithm::EcdsaP256 => (
                digest::digest(&digest::SHA256, tbs).as_ref().to_vec(),
                Mechanism::Ecdsa,
            ),
            KeyAlgorithm::EcdsaP384 => (
                digest::digest(&digest::SHA384, tbs).as_ref().to_vec(),
                Mechanism::Ecdsa,
            ),
            KeyAlgorithm::Rsa => (tbs.to_vec(), Mechanism::Sha256RsaPkcs),
        };
        let mut attempt = 0;
        let raw = loop {
            attempt += 1;
            match self.sign_once(&data, &mech) {
                Ok(sig) => break sig,
                Err((Recovery::None, _, e)) => return Err(e),
                Err((rec, generation, e)) if attempt >= 2 => {
                    tracing::error!(?rec, generation, error = %e, "PKCS#11 signature failed after a reconnect");
                    return Err(SignerError::Unavailable(e.to_string()));
                }
                Err((Recovery::Session, _, e)) => {
                    tracing::warn!(error = %e, "PKCS#11 session lost; retrying on a new session");
                    // Session loss and logout hit every session of this
                    // application: start over with a fresh, logged-in one.
                    self.drop_idle();
                }
                Err((Recovery::Module, generation, e)) => {
                    tracing::warn!(error = %e, "PKCS#11 module or token failed; reconnecting");
                    self.reconnect(Some(generation))?;
                }
            }
        };
        match self.algorithm.ec_field_len() {
            Some(n) => ecdsa_raw_to_der(&raw, n),
            None => Ok(raw),
        }
    }
    fn kind(&self) -> &'static str {
        "pkcs11"
    }
    fn describe(&self) -> String {
        self.uri.to_string()
    }
}

/// Key types `meshca init --pkcs11` can generate in a token.
pub fn generate_key(
    uri: &Pkcs11Uri,
    key_type: crate::ca::generate::KeyType,
) -> Result<(), SignerError> {
    use crate::ca::generate::KeyType as K;
    let pin = AuthPin::from(uri.read_pin()?.as_str().to_string());
    let ctx = load_module(uri)?;
    let (slot, token) = find_slot(&ctx, uri)?;
    let session = ctx
        .open_rw_session(slot)
        .map_err(|e| SignerError::Device(format!("opening a read-write session: {}", short(&e))))?;
    login(&session, &pin, &token)?;
    if find_one(&session, uri, &token, ObjectClass::PRIVATE_KEY)?.is_some() {
        return Err(SignerError::KeyAmbiguous {
            token,
            what: format!(
                "{} (a key already exists; refusing to make a second one)",
                uri.key_description()
            ),
            count: 1,
        });
    }
    let mut names = Vec::new();
    if let Some(o) = &uri.object {
        names.push(Attribute::Label(o.as_bytes().to_vec()));
    }
    if let Some(id) = &uri.id {
        names.push(Attribute::Id(id.clone()));
    }
    let mut private = vec![
        Attribute::Token(true),
        Attribute::Private(true),
        Attribute::Sensitive(true),
        Attribute::Extractable(false),
        Attribute::Sign(true),
    ];
    private.extend(names.iter().cloned());
    let mut public = vec![
        Attribute::Token(true),
        Attribute::Private(false),
        Attribute::Verify(true),
    ];
    public.extend(names);
    let mech = match key_type {
        K::EcdsaP256 | K::EcdsaP384 => {
            let oid = if key_type == K::EcdsaP256 {
                OID_P256
            } else {
                OID_P384
            };
            public.push(Attribute::EcParams(oid.to_vec()));
            Mechanism::EccKeyPairGen
        }
        K::Rsa2048 | K::Rsa3072 | K::Rsa4096 => {
            let bits: u64 = match key_type {
                K::Rsa2048 => 2048,
                K::Rsa3072 => 3072,
                _ => 4096,
            };
            public.push(Attribute::ModulusBits(bits.into()));
            public.push(Attribute::PublicExponent(vec![1, 0, 1]));
            Mechanism::RsaPkcsKeyPairGen
        }
    };
    session
        .generate_key_pair(&mech, &public, &private)
        .map_err(|e| SignerError::Device(format!("generating the key pair: {}", short(&e))))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case(RvError::SessionHandleInvalid, Recovery::Session)]
    #[test_case(RvError::SessionClosed, Recovery::Session)]
    #[test_case(RvError::UserNotLoggedIn, Recovery::Session)]
    #[test_case(RvError::DeviceRemoved, Recovery::Module)]
    #[test_case(RvError::DeviceError, Recovery::Module)]
    #[test_case(RvError::TokenNotPresent, Recovery::Module)]
    #[test_case(RvError::CryptokiNotInitialized, Recovery::Module)]
    #[test_case(RvError::KeyHandleInvalid, Recovery::Module)]
    #[test_case(RvError::GeneralError, Recovery::Module)]
    #[test_case(RvError::DataLenRange, Recovery::None)]
    #[test_case(RvError::MechanismInvalid, Recovery::None)]
    #[test_case(RvError::PinIncorrect, Recovery::None)]
    fn recovery_per_return_value(rv: RvError, want: Recovery) {
        assert_eq!(recovery(rv), want);
    }

    #[test]
    fn ec_point_accepts_wrapped_and_bare_points_only() {
        let bare = [vec![4u8], vec![7u8; 64]].concat();
        let wrapped = [vec![4u8, 65], bare.clone()].concat();
        assert_eq!(ec_point(&bare, KeyAlgorithm::EcdsaP256).unwrap(), bare);
        assert_eq!(ec_point(&wrapped, KeyAlgorithm::EcdsaP256).unwrap(), bare);
        assert!(ec_point(&bare, KeyAlgorithm::EcdsaP384).is_err());
        assert!(ec_point(&bare[..33], KeyAlgorithm::EcdsaP256).is_err());
    }

    #[test]
    fn rsa_public_key_matches_aws_lc() {
        use aws_lc_rs::signature::KeyPair;
        let kp = aws_lc_rs::rsa::KeyPair::generate(aws_lc_rs::rsa::KeySize::Rsa2048).unwrap();
        let pk = kp.public_key();
        let n = pk.modulus().big_endian_without_leading_zero();
        let e = pk.exponent().big_endian_without_leading_zero();
        assert_eq!(rsa_public_key(n, e), kp.public_key().as_ref());
    }
}
