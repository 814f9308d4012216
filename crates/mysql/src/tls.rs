//! TLS to a shard: the `tls:` section of its config as mysql_async's connection options.

use mysql_async::OptsBuilder;
use shardlock_core::config::{TlsConfig, TlsMode};
use shardlock_core::ConfigError;

/// `opts` with TLS as `tls` asks (the shard at `index` of `shards`, for errors). Files are
/// checked here, so that a missing one is a config error naming its field, not a failure of
/// every connection.
pub(crate) fn apply(
    opts: OptsBuilder,
    tls: &TlsConfig,
    index: usize,
) -> Result<OptsBuilder, ConfigError> {
    if tls.mode == TlsMode::Disabled {
        return Ok(opts);
    }
    // As the driver reads the URL (`%73ocket=` is `socket=`): through a socket file it would
    // not use TLS, and say nothing. `preferred` allows plaintext, so that one may.
    if tls.mode != TlsMode::Preferred && mysql_async::Opts::from(opts.clone()).socket().is_some() {
        return Err(ConfigError::field(
            format!("shards[{index}].url"),
            "a connection through a socket file (`socket=` in the URL) does not use TLS: \
             remove `socket=`, or set tls.mode to preferred or disabled",
        ));
    }
    for (name, file) in [
        ("ca-file", &tls.ca_file),
        ("cert-file", &tls.cert_file),
        ("key-file", &tls.key_file),
    ] {
        if let Some(path) = file {
            std::fs::metadata(path).map_err(|e| {
                ConfigError::field(
                    format!("shards[{index}].tls.{name}"),
                    format!("cannot read {}: {e}", path.display()),
                )
            })?;
        }
    }
    ssl(opts, tls, index)
}

#[cfg(feature = "tls")]
fn ssl(opts: OptsBuilder, tls: &TlsConfig, _index: usize) -> Result<OptsBuilder, ConfigError> {
    use mysql_async::{ClientIdentity, SslOpts};
    let check_chain = matches!(tls.mode, TlsMode::VerifyCa | TlsMode::VerifyIdentity);
    // verify-ca checks the name too, here: mysql_async 0.37 cannot skip only the name check
    // (it recognises a name mismatch by the text of rustls' error, which rustls no longer
    // writes so: blackbeam/mysql_async#404). The pool passes the name the server's
    // certificate holds instead ([`certificate_name`]), which is what verify-ca accepts.
    let mut ssl = SslOpts::default()
        .with_danger_accept_invalid_certs(!check_chain)
        .with_danger_skip_domain_validation(!check_chain);
    if let Some(ca) = &tls.ca_file {
        // The configured CA alone: a certificate some public CA signed is not the shard's.
        ssl = ssl
            .with_root_certs(vec![ca.clone().into()])
            .with_disable_built_in_roots(true);
    }
    if let Some(name) = &tls.server_name {
        ssl = ssl.with_danger_tls_hostname_override(Some(name.clone()));
    }
    if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
        ssl = ssl.with_client_identity(Some(ClientIdentity::new(
            cert.clone().into(),
            key.clone().into(),
        )));
    }
    // Through the server's socket file (which mysql_async prefers for a local server) the
    // session would skip TLS.
    Ok(opts.ssl_opts(Some(ssl)).prefer_socket(false))
}

#[cfg(not(feature = "tls"))]
fn ssl(_opts: OptsBuilder, _tls: &TlsConfig, index: usize) -> Result<OptsBuilder, ConfigError> {
    Err(ConfigError::field(
        format!("shards[{index}].tls.mode"),
        "this build of shardlock has no TLS: enable its `tls` feature",
    ))
}

/// The name to check a `verify-ca` shard's certificate for: one its certificate at
/// `host:port` holds and is valid for, once its chain is checked against `ca_file`. verify-ca
/// accepts any name the CA signed, so checking the connection for a name read off the
/// certificate this way accepts exactly what verify-ca does (a server whose certificate the
/// CA did not sign is refused here already).
///
/// Speaks the start of MySQL's protocol: reads the server's greeting, asks for TLS
/// (SSLRequest), and reads the certificate in the TLS handshake, which it then abandons. A
/// server that refuses the connection outright (too many connections, a host not allowed)
/// answers with its MySQL error.
#[cfg(feature = "tls")]
pub(crate) async fn certificate_name(
    host: &str,
    port: u16,
    ca_file: &std::path::Path,
) -> mysql_async::Result<String> {
    use std::sync::{Arc, Mutex};

    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::client::WebPkiServerVerifier;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Checks the chain, finds a name the certificate is valid for, then ends the handshake.
    #[derive(Debug)]
    struct ReadName {
        chain: Arc<WebPkiServerVerifier>,
        found: Mutex<Option<Result<String, String>>>,
    }
    impl ReadName {
        fn find(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            asked: &ServerName<'_>,
            ocsp: &[u8],
            now: UnixTime,
        ) -> Result<String, String> {
            let valid_for = |name: &ServerName<'_>| {
                self.chain
                    .verify_server_cert(end_entity, intermediates, name, ocsp, now)
            };
            // The chain is checked before the name: a name error means a good chain.
            let presented = match valid_for(asked) {
                Ok(_) => return Ok(asked.to_str().into_owned()),
                Err(rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForNameContext { presented, .. },
                )) => presented,
                Err(e) => return Err(format!("not accepted under ca-file: {e}")),
            };
            // The first presented name the certificate proves valid for (the same check the
            // connection makes next).
            presented
                .iter()
                .filter_map(|p| presented_name(p))
                .find(|name| {
                    ServerName::try_from(name.as_str()).is_ok_and(|n| valid_for(&n).is_ok())
                })
                .ok_or_else(|| {
                    format!(
                        "holds no subjectAltName this connection can be checked for \
                         ({presented:?}); verify-ca needs a DNS name or IP address in it"
                    )
                })
        }
    }
    impl ServerCertVerifier for ReadName {
        fn verify_server_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            server_name: &ServerName<'_>,
            ocsp: &[u8],
            now: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            let found = self.find(end_entity, intermediates, server_name, ocsp, now);
            *self.found.lock().unwrap_or_else(|e| e.into_inner()) = Some(found);
            Err(rustls::Error::General("certificate read".into()))
        }
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.chain.verify_tls12_signature(message, cert, dss)
        }
        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.chain.verify_tls13_signature(message, cert, dss)
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.chain.supported_verify_schemes()
        }
    }

    let failed = |what: &dyn std::fmt::Display| {
        mysql_async::Error::Io(
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("verify-ca: {what}"),
            )
            .into(),
        )
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca_file).map_err(|e| failed(&e))? {
        roots
            .add(cert.map_err(|e| failed(&e))?)
            .map_err(|e| failed(&e))?;
    }
    let chain = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| failed(&e))?;
    let verifier = Arc::new(ReadName {
        chain,
        found: Mutex::new(None),
    });
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| failed(&e))?
        .dangerous()
        .with_custom_certificate_verifier(verifier.clone())
        .with_no_client_auth();

    let io = |e: std::io::Error| mysql_async::Error::Io(e.into());
    let mut stream = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(io)?;
    // The greeting: a 4-byte header (length, sequence), then the payload (a few hundred
    // bytes; a server that claims more than 64 KiB is not one to read).
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).await.map_err(io)?;
    let length = u32::from_le_bytes([header[0], header[1], header[2], 0]) as usize;
    if length > 64 * 1024 {
        return Err(failed(&format!("a greeting of {length} bytes")));
    }
    let mut greeting = vec![0u8; length];
    stream.read_exact(&mut greeting).await.map_err(io)?;
    match greeting.first() {
        // An error packet: code, then the message (a `#` and SQL state first, if any).
        Some(0xff) if greeting.len() >= 3 => {
            let code = u16::from_le_bytes([greeting[1], greeting[2]]);
            let rest = &greeting[3..];
            let (state, message) = match rest.first() {
                Some(b'#') if rest.len() >= 6 => (&rest[1..6], &rest[6..]),
                _ => (&b"HY000"[..], rest),
            };
            return Err(mysql_async::Error::Server(mysql_async::ServerError {
                code,
                message: String::from_utf8_lossy(message).into_owned(),
                state: String::from_utf8_lossy(state).into_owned(),
            }));
        }
        Some(10) => {}
        _ => return Err(failed(&"the server's greeting is not MySQL protocol 10")),
    }
    // NUL-terminated server version, connection id (4), auth data (8), filler (1), then the
    // low two bytes of the capability flags.
    let version_end = greeting
        .iter()
        .skip(1)
        .position(|b| *b == 0)
        .map(|at| at + 2)
        .ok_or_else(|| failed(&"a malformed greeting"))?;
    let flags_at = version_end + 4 + 8 + 1;
    let flags = greeting
        .get(flags_at..flags_at + 2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .ok_or_else(|| failed(&"a malformed greeting"))?;
    const CLIENT_SSL: u32 = 0x0800;
    if u32::from(flags) & CLIENT_SSL == 0 {
        return Err(failed(&"the server offers no TLS"));
    }
    // SSLRequest: capabilities (protocol 4.1, secure connection, TLS), max packet, charset,
    // 23 bytes of filler; sequence 1.
    let capabilities: u32 = 0x0000_0200 | 0x0000_8000 | CLIENT_SSL;
    let mut request = vec![32, 0, 0, 1];
    request.extend_from_slice(&capabilities.to_le_bytes());
    request.extend_from_slice(&(16u32 << 20).to_le_bytes());
    request.push(45); // utf8mb4
    request.extend_from_slice(&[0; 23]);
    stream.write_all(&request).await.map_err(io)?;

    let name = ServerName::try_from(host.to_owned()).map_err(|e| failed(&e))?;
    // Fails by design once the certificate is read.
    let _ = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, stream)
        .await;
    let found = verifier
        .found
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    match found {
        None => Err(failed(&"the TLS handshake ended before a certificate came")),
        Some(Err(why)) => Err(failed(&format!("the server's certificate {why}"))),
        Some(Ok(name)) => Ok(name),
    }
}

/// A name rustls says a certificate presents — `DnsName("db.internal")`,
/// `IpAddress(10.0.0.7)` (webpki's `Debug` of its names) — as a name to check it for; a
/// wildcard stands for one label, so any one will do. `None` for other kinds of names (a URI,
/// a directory name) and for any other writing. Each is only a candidate: the probe uses one
/// the certificate proves valid for, and fails closed, listing them, when none is.
#[cfg(feature = "tls")]
fn presented_name(presented: &str) -> Option<String> {
    let name = if let Some(dns) = presented.strip_prefix("DnsName(\"") {
        dns.strip_suffix("\")")?
    } else {
        presented.strip_prefix("IpAddress(")?.strip_suffix(')')?
    };
    Some(match name.strip_prefix("*.") {
        Some(rest) => format!("shardlock.{rest}"),
        None => name.to_owned(),
    })
}

#[cfg(all(test, feature = "tls"))]
mod tests {
    /// A URL that reaches the server through a socket file is refused with a TLS mode that
    /// requires TLS, however the URL spells `socket`.
    #[test]
    fn tls_through_a_socket_file_is_refused_by_field() {
        use shardlock_core::config::{ShardConfig, TlsConfig, TlsMode};
        let shard = |url: &str, mode: TlsMode| {
            let mut tls = TlsConfig::default();
            tls.mode = mode;
            let mut shard = ShardConfig::default();
            shard.name = "s1".into();
            shard.url = url.into();
            shard.tls = tls;
            shard
        };
        for url in [
            "mysql://root@localhost:3306/shardlock?socket=/run/mysqld/mysqld.sock",
            "mysql://root@localhost:3306/shardlock?%73ocket=/run/mysqld/mysqld.sock",
        ] {
            let e = crate::connect_opts(&shard(url, TlsMode::Required), 0).unwrap_err();
            assert_eq!(e.field.as_deref(), Some("shards[0].url"), "{url}: {e}");
            crate::connect_opts(&shard(url, TlsMode::Preferred), 0).unwrap();
            crate::connect_opts(&shard(url, TlsMode::Disabled), 0).unwrap();
        }
        crate::connect_opts(
            &shard("mysql://root@localhost:3306/shardlock", TlsMode::Required),
            0,
        )
        .unwrap();
    }

    #[test]
    fn presented_names_are_read_as_rustls_writes_them() {
        for (presented, want) in [
            ("DnsName(\"db-1.internal\")", Some("db-1.internal")),
            ("DnsName(\"*.db.internal\")", Some("shardlock.db.internal")),
            ("IpAddress(10.0.0.7)", Some("10.0.0.7")),
            ("IpAddress(2001:db8::1)", Some("2001:db8::1")),
            ("UniformResourceIdentifier(\"spiffe://x\")", None),
            ("DirectoryName", None),
        ] {
            assert_eq!(
                super::presented_name(presented).as_deref(),
                want,
                "{presented}"
            );
        }
    }
}
