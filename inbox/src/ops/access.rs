//! Who may use the operator plane: tokens read from files, and the page's
//! sessions.
//!
//! A token file holds one token a line, `NAME ROLE TOKEN` (`#` starts a
//! comment): the name is written in the audit, the role is `reader`,
//! `operator` or `admin`, the token is at least 16 characters. Only the
//! tokens' SHA-256 digests are kept in memory, and a presented token is
//! compared by its digest, so its comparison tells nothing of it.
//!
//! The page asks for a token once and keeps a session in a cookie
//! (`HttpOnly`, `SameSite=Strict`, `Path=/ops`): the name, its expiry and
//! an HMAC-SHA256 of both, under a key derived from the token files' text.
//! Every instance with the same files accepts the same sessions, across
//! restarts; a changed file (a token revoked, a role changed) ends every
//! session. Each page form carries a token derived from the session (its
//! HMAC under the same key), which a cross-site form cannot know.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use hmac::{KeyInit, Mac};
use sha2::{Digest, Sha256};

use super::{Operator, Role};
use crate::error::{Error, ErrorKind, Result};

type HmacSha256 = hmac::Hmac<Sha256>;

/// How long a page session lasts.
pub const SESSION_LIFETIME: Duration = Duration::from_secs(8 * 3600);
/// The shortest token taken.
const MIN_TOKEN_CHARS: usize = 16;

/// The tokens the operator plane accepts, and its sessions' key.
#[derive(Clone)]
pub struct Access {
    tokens: Vec<Token>,
    key: [u8; 32],
}

#[derive(Clone)]
struct Token {
    name: String,
    role: Role,
    digest: [u8; 32],
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Names and roles only: nothing secret in a log.
        f.debug_list()
            .entries(
                self.tokens
                    .iter()
                    .map(|t| format!("{} ({})", t.name, t.role.as_str())),
            )
            .finish()
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0; 32];
    out.copy_from_slice(&Sha256::digest(bytes));
    out
}

fn access_error(path: &Path, line: Option<usize>, what: impl std::fmt::Display) -> Error {
    let at = match line {
        Some(line) => format!("{}:{line}", path.display()),
        None => path.display().to_string(),
    };
    Error::new(ErrorKind::Settings, format!("failures.token_files: {at}: {what}"))
}

impl Access {
    /// The tokens of `failures.token_files`.
    pub fn from_settings(settings: &crate::Settings) -> Result<Self> {
        Self::from_files(&settings.failures.token_files)
    }

    /// The tokens of these files. An error names the file and line, never
    /// a token.
    pub fn from_files(paths: &[PathBuf]) -> Result<Self> {
        if paths.is_empty() {
            return Err(Error::setting(
                "failures.token_files",
                "names no file: the operator plane takes no request without a token",
            ));
        }
        let mut tokens: Vec<Token> = Vec::new();
        let mut key = Sha256::new();
        key.update(b"inbox operator plane sessions v1\0");
        for path in paths {
            let text = std::fs::read_to_string(path).map_err(|e| access_error(path, None, e))?;
            key.update(text.as_bytes());
            key.update(b"\0");
            for (i, line) in text.lines().enumerate() {
                let line = line.split('#').next().unwrap_or_default().trim();
                if line.is_empty() {
                    continue;
                }
                let at = Some(i + 1);
                let fields: Vec<&str> = line.split_whitespace().collect();
                let [name, role, token] = fields.as_slice() else {
                    return Err(access_error(path, at, "expected `NAME ROLE TOKEN`"));
                };
                if !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._@-".contains(c))
                {
                    return Err(access_error(
                        path,
                        at,
                        format!("name `{name}`: letters, digits and ._@- only"),
                    ));
                }
                let role: Role = role.parse().map_err(|e| access_error(path, at, e))?;
                if token.chars().count() < MIN_TOKEN_CHARS {
                    return Err(access_error(
                        path,
                        at,
                        format!("{name}'s token is shorter than {MIN_TOKEN_CHARS} characters"),
                    ));
                }
                let digest = digest(token.as_bytes());
                if tokens.iter().any(|t| t.name == *name) {
                    return Err(access_error(path, at, format!("`{name}` is named twice")));
                }
                if tokens.iter().any(|t| t.digest == digest) {
                    return Err(access_error(path, at, format!("{name}'s token is another's too")));
                }
                tokens.push(Token {
                    name: (*name).to_owned(),
                    role,
                    digest,
                });
            }
        }
        if tokens.is_empty() {
            return Err(access_error(&paths[0], None, "holds no token"));
        }
        let mut out = [0; 32];
        out.copy_from_slice(&key.finalize());
        Ok(Self { tokens, key: out })
    }

    /// Who `token` is, if anyone.
    pub fn token(&self, token: &str) -> Option<Operator> {
        let presented = digest(token.as_bytes());
        // Every token compared, all of its bytes: the time taken is the
        // same whichever matches.
        let mut found = None;
        for known in &self.tokens {
            let differs = known
                .digest
                .iter()
                .zip(&presented)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b));
            if differs == 0 {
                found = Some(known);
            }
        }
        found.map(|t| Operator::new(t.name.clone(), t.role))
    }

    /// Who an `Authorization` header's bearer token is.
    pub fn bearer(&self, authorization: Option<&str>) -> Option<Operator> {
        let value = authorization?.trim();
        let (scheme, token) = value.split_once(' ')?;
        match scheme.eq_ignore_ascii_case("bearer") {
            true => self.token(token.trim()),
            false => None,
        }
    }

    fn mac(&self, parts: &[&str]) -> Option<String> {
        let mut mac = HmacSha256::new_from_slice(&self.key).ok()?;
        for part in parts {
            mac.update(part.as_bytes());
            mac.update(b"\0");
        }
        Some(hex(&mac.finalize().into_bytes()))
    }

    /// A session for `who`, from `now`: the cookie's value.
    pub fn session(&self, who: &Operator, now: SystemTime) -> Option<String> {
        let expires = (now + SESSION_LIFETIME)
            .duration_since(SystemTime::UNIX_EPOCH)
            .ok()?
            .as_secs();
        let expires = expires.to_string();
        let mac = self.mac(&["session", &who.name, &expires])?;
        Some(format!("{}.{expires}.{mac}", who.name))
    }

    /// Who a session cookie's value is, if it is one of ours, not expired
    /// at `now`, and its name still has a token (with the role it has now).
    pub fn session_of(&self, value: &str, now: SystemTime) -> Option<Operator> {
        let (rest, mac) = value.rsplit_once('.')?;
        let (name, expires) = rest.rsplit_once('.')?;
        let mut check = HmacSha256::new_from_slice(&self.key).ok()?;
        for part in ["session", name, expires] {
            check.update(part.as_bytes());
            check.update(b"\0");
        }
        check.verify_slice(&unhex(mac)?).ok()?;
        let expires = SystemTime::UNIX_EPOCH + Duration::from_secs(expires.parse().ok()?);
        if expires <= now {
            return None;
        }
        let token = self.tokens.iter().find(|t| t.name == name)?;
        Some(Operator::new(token.name.clone(), token.role))
    }

    /// The token a page form of session `session` carries.
    pub fn form_token(&self, session: &str) -> Option<String> {
        self.mac(&["form", session])
    }

    /// Whether `presented` is the form token of `session`.
    pub fn is_form_token(&self, session: &str, presented: &str) -> bool {
        let (Ok(mut check), Some(presented)) = (HmacSha256::new_from_slice(&self.key), unhex(presented))
        else {
            return false;
        };
        for part in ["form", session] {
            check.update(part.as_bytes());
            check.update(b"\0");
        }
        check.verify_slice(&presented).is_ok()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(text: &str) -> Result<Access> {
        let dir = std::env::temp_dir().join(format!("inbox-access-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokens");
        std::fs::write(&path, text).unwrap();
        let access = Access::from_files(&[path]);
        std::fs::remove_dir_all(&dir).unwrap();
        access
    }

    #[test]
    fn tokens_are_read_with_their_names_and_roles() {
        let access = access(
            "# on call\nalice admin aaaaaaaaaaaaaaaaaaaa\n\nbob reader bbbbbbbbbbbbbbbbbbbb # read only\n",
        )
        .unwrap();
        assert_eq!(
            access.token("aaaaaaaaaaaaaaaaaaaa"),
            Some(Operator::new("alice", Role::Admin))
        );
        assert_eq!(
            access.bearer(Some("Bearer bbbbbbbbbbbbbbbbbbbb")),
            Some(Operator::new("bob", Role::Reader))
        );
        assert_eq!(access.bearer(Some("Basic bbbbbbbbbbbbbbbbbbbb")), None);
        assert_eq!(access.token("nobody's token at all"), None);
        assert!(!format!("{access:?}").contains("aaaa"), "no token in a log");
    }

    #[test]
    fn a_bad_file_is_refused_by_its_line_never_showing_a_token() {
        let short = access("alice admin short\n").unwrap_err().to_string();
        assert!(short.contains(":1:") && short.contains("shorter"), "{short}");
        assert!(!short.contains("short\n"));
        let role = access("alice root aaaaaaaaaaaaaaaaaaaa\n")
            .unwrap_err()
            .to_string();
        assert!(role.contains("role `root`"), "{role}");
        let twice = access("a reader aaaaaaaaaaaaaaaaaaaa\nb reader aaaaaaaaaaaaaaaaaaaa\n")
            .unwrap_err()
            .to_string();
        assert!(twice.contains(":2:") && !twice.contains("aaaa"), "{twice}");
        assert!(access("# nothing\n").is_err());
    }

    #[test]
    fn a_session_holds_until_it_expires_or_its_token_goes() {
        let access = access("alice operator aaaaaaaaaaaaaaaaaaaa\n").unwrap();
        let now = SystemTime::now();
        let alice = Operator::new("alice", Role::Operator);
        let session = access.session(&alice, now).unwrap();
        assert_eq!(access.session_of(&session, now), Some(alice.clone()));
        assert_eq!(access.session_of(&session, now + SESSION_LIFETIME), None);
        let forged = session.replace("alice.", "mallory.");
        assert_eq!(access.session_of(&forged, now), None);
        // Other files, another key: the session is over.
        let other = super::tests::access("alice operator cccccccccccccccccccc\n").unwrap();
        assert_eq!(other.session_of(&session, now), None);
        let form = access.form_token(&session).unwrap();
        assert!(access.is_form_token(&session, &form));
        assert!(!access.is_form_token(&forged, &form));
        assert!(!access.is_form_token(&session, "00"));
    }
}
