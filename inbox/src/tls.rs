//! TLS for both connections: one rustls stack, with ring's cryptography
//! (no C toolchain beyond a C compiler, no cmake), builds the client
//! configuration that PostgreSQL's connections and RabbitMQ's use alike
//! (docs/decisions.md, "TLS").
//!
//! What is trusted is the caller's choice ([`Verify`]): a private CA's
//! file, or the system's trust store; the server's name, or only its chain
//! (libpq's `verify-ca`); or nothing (libpq's `prefer` and `require`,
//! which encrypt without knowing whom they talk to). A client certificate
//! can be added. Files are read as the configuration is built, at start
//! and at each broker connection, so that an error names the setting that
//! gave the path, and a rotated certificate is picked up by the next
//! connection.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::error::{Error, Result};

/// What a connection checks of the server's certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verify {
    /// The chain up to a trusted CA, and that the certificate names the
    /// host connected to (libpq's `verify-full`; every `amqps://`).
    Full(Roots),
    /// The chain only (libpq's `verify-ca`).
    ChainOnly(Roots),
    /// Nothing: encrypted, but to whoever answers (libpq's `prefer` and
    /// `require`).
    Nothing,
}

/// Which CAs are trusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Roots {
    /// The operating system's trust store (`SSL_CERT_FILE` and
    /// `SSL_CERT_DIR` are honoured).
    System,
    /// Only the CA certificates in this PEM file, named by `setting`.
    File { path: PathBuf, setting: String },
}

/// A client certificate and its key, each a PEM file named by a setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) cert: PathBuf,
    pub(crate) cert_setting: String,
    pub(crate) key: PathBuf,
    pub(crate) key_setting: String,
}

/// The rustls client configuration for `verify`, presenting `identity` if
/// the server asks for a client certificate. A file that cannot be read,
/// holds no certificate or no usable key fails naming its setting and its
/// path, never its contents.
pub(crate) fn client_config(verify: &Verify, identity: Option<&Identity>) -> Result<Arc<ClientConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::setting("tls", format!("no TLS version to offer: {e}")))?;
    let builder = match verify {
        Verify::Full(roots) => builder.with_root_certificates(root_store(roots)?),
        Verify::ChainOnly(roots) => {
            let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
                Arc::new(root_store(roots)?),
                provider.clone(),
            )
            .build()
            .map_err(|e| Error::setting(roots.setting(), format!("cannot verify with these CAs: {e}")))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly(inner)))
        }
        Verify::Nothing => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider))),
    };
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some(identity) => {
            let certs = read_certs(&identity.cert, &identity.cert_setting)?;
            let key = read_key(&identity.key, &identity.key_setting)?;
            builder.with_client_auth_cert(certs, key).map_err(|e| {
                Error::setting(&identity.key_setting, format!("{}: {e}", identity.key.display()))
            })?
        }
    };
    Ok(Arc::new(config))
}

impl Roots {
    /// The setting that chose these roots, for errors.
    fn setting(&self) -> &str {
        match self {
            Roots::System => "the system's trust store",
            Roots::File { setting, .. } => setting,
        }
    }
}

fn root_store(roots: &Roots) -> Result<RootCertStore> {
    let mut store = RootCertStore::empty();
    match roots {
        Roots::File { path, setting } => {
            let (added, _ignored) = store.add_parsable_certificates(read_certs(path, setting)?);
            if added == 0 {
                return Err(Error::setting(
                    setting,
                    format!("{}: no CA certificate rustls can use", path.display()),
                ));
            }
        }
        Roots::System => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _ignored) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found.errors.first().map(ToString::to_string).unwrap_or_default();
                return Err(Error::setting(
                    "tls",
                    format!(
                        "the system's trust store has no CA certificate ({why}); name the CA's file \
                         (sslrootcert, cacertfile or message_bus.tls_ca_file)"
                    ),
                ));
            }
        }
    }
    Ok(store)
}

fn read_certs(path: &Path, setting: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| {
            Error::setting(
                setting,
                format!("cannot read {}: {}", path.display(), pem_error(&e)),
            )
        })?;
    if certs.is_empty() {
        return Err(Error::setting(
            setting,
            format!("{} holds no PEM certificate", path.display()),
        ));
    }
    Ok(certs)
}

fn read_key(path: &Path, setting: &str) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        Error::setting(
            setting,
            format!(
                "cannot read {}: {} (an unencrypted PEM key is needed: PKCS#8, PKCS#1 or SEC1)",
                path.display(),
                pem_error(&e)
            ),
        )
    })
}

/// A PEM error in words, without the file's bytes.
fn pem_error(error: &rustls::pki_types::pem::Error) -> String {
    use rustls::pki_types::pem::Error as Pem;
    match error {
        Pem::Io(io) => io.to_string(),
        Pem::NoItemsFound => "no PEM item of the expected kind".into(),
        Pem::MissingSectionEnd { .. } | Pem::IllegalSectionStart { .. } => {
            "a PEM section is malformed".into()
        }
        Pem::Base64Decode(_) => "a PEM section is not valid base64".into(),
        _ => "not a PEM file rustls can read".into(),
    }
}

/// A TLS failure in words a reader of the log can act on.
pub(crate) fn explain(error: &rustls::Error) -> String {
    match error {
        rustls::Error::InvalidCertificate(certificate) => match certificate {
            CertificateError::UnknownIssuer => {
                "the server's certificate is not signed by a trusted CA (unknown issuer)".into()
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                "the server's certificate has expired".into()
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                "the server's certificate is not valid yet".into()
            }
            CertificateError::NotValidForName => {
                "the server's certificate does not name the host connected to (host name mismatch)".into()
            }
            CertificateError::NotValidForNameContext { expected, presented } => format!(
                "the server's certificate is not valid for `{}` (host name mismatch; it names {})",
                expected.to_str(),
                presented.join(", ")
            ),
            CertificateError::Revoked => "the server's certificate is revoked".into(),
            other => format!("the server's certificate was refused: {other:?}"),
        },
        rustls::Error::AlertReceived(alert) => {
            format!("the server refused the TLS handshake ({alert:?}): does it want a client certificate?")
        }
        other => format!("TLS failed: {other}"),
    }
}

/// libpq's `verify-ca`: the chain is checked, the name is not.
#[derive(Debug)]
struct ChainOnly(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        // webpki checks the name last, once the chain has passed.
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// libpq's `prefer` and `require`: any certificate is taken, but the
/// handshake's signatures are still checked (the session is encrypted to
/// the key the certificate holds).
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
